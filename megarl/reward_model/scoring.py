"""A reward model's score of a sequence: its scalar head read at the sequence's last token
(as transformers' ``*ForSequenceClassification`` reads it at the last non-pad token)."""

from __future__ import annotations

import torch


def last_token_scores(output: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """``[b, s, 1]`` head output -> ``[b]`` scores at positions ``seq_lens - 1``."""
    rows = torch.arange(output.shape[0], device=output.device)
    return output[rows, seq_lens.to(output.device) - 1, 0].float()


@torch.no_grad()
def score_sequences(
    model, input_ids: torch.Tensor, seq_lens: torch.Tensor, micro_batch_size: int
) -> torch.Tensor:
    """``[N]`` scores of right-padded sequences (on the model's device, as ``input_ids`` must be),
    forward-only through the pipeline schedule; the same tensor on every rank of the
    model-parallel group. Collective over TP and PP."""
    from megarl.models.forward import broadcast_from_last_stage, run_schedule

    n = int(input_ids.shape[0])
    device = input_ids.device
    lens = seq_lens.tolist()
    order = sorted(range(n), key=lambda i: (lens[i], i))
    chunks = [order[s : s + micro_batch_size] for s in range(0, n, micro_batch_size)]
    batches = []
    for chunk in chunks:
        idx = torch.as_tensor(chunk, dtype=torch.long, device=device)
        width = max(lens[i] for i in chunk)
        batches.append({"input_ids": input_ids[idx, :width], "lens": seq_lens[idx]})
    outs = run_schedule(
        [model],
        batches,
        lambda out, b: (out.sum() * 0.0, {"score": last_token_scores(out, b["lens"])}),
        forward_only=True,
    )
    scores = torch.zeros(n, dtype=torch.float32, device=device)
    for chunk, out in zip(chunks, outs, strict=False):  # outputs exist on the last stage only
        scores[torch.as_tensor(chunk, dtype=torch.long, device=device)] = out["score"]
    return broadcast_from_last_stage(scores)
