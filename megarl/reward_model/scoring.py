"""A reward model's score of a sequence: its scalar head read at the sequence's last non-pad
token, where transformers' ``*ForSequenceClassification`` reads it. When the pad token is also
the EOS token, a response that ends with EOS is scored at the token before it, as there."""

from __future__ import annotations

import torch


def last_non_pad_positions(
    input_ids: torch.Tensor, seq_lens: torch.Tensor, pad_id: int | None
) -> torch.Tensor:
    """``[b]`` index of the last token of each row (within ``seq_lens``) that is not ``pad_id``;
    the row's first position when every token is pad. ``pad_id=None``: ``seq_lens - 1``."""
    lens = seq_lens.to(input_ids.device)
    if pad_id is None:
        return lens - 1
    index = torch.arange(input_ids.shape[1], device=input_ids.device)
    real = (input_ids != pad_id) & (index < lens.unsqueeze(1))
    return (index * real).amax(dim=1)


def last_token_scores(
    output: torch.Tensor,
    seq_lens: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    pad_id: int | None = None,
) -> torch.Tensor:
    """``[b, s, 1]`` head output -> ``[b]`` scores at the last non-pad token of each row (with
    ``input_ids`` and ``pad_id``), else at ``seq_lens - 1``."""
    if input_ids is None:
        positions = seq_lens.to(output.device) - 1
    else:
        positions = last_non_pad_positions(input_ids, seq_lens, pad_id).to(output.device)
    rows = torch.arange(output.shape[0], device=output.device)
    return output[rows, positions, 0].float()


@torch.no_grad()
def score_sequences(
    model,
    input_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    micro_batch_size: int,
    pad_id: int | None = None,
) -> torch.Tensor:
    """``[N]`` scores of right-padded sequences, forward-only through the pipeline schedule; the
    same tensor on every rank of the model-parallel group. Collective over TP and PP."""
    from megarl.models.forward import broadcast_from_last_stage, run_schedule

    n = int(input_ids.shape[0])
    order = sorted(range(n), key=lambda i: (int(seq_lens[i]), i))
    chunks = [order[s : s + micro_batch_size] for s in range(0, n, micro_batch_size)]
    batches = []
    for chunk in chunks:
        idx = torch.as_tensor(chunk, dtype=torch.long)
        width = int(seq_lens[idx].max())
        batches.append({"input_ids": input_ids[idx, :width], "lens": seq_lens[idx]})
    outs = run_schedule(
        [model],
        batches,
        lambda out, b: (
            out.sum() * 0.0,
            {"score": last_token_scores(out, b["lens"], b["input_ids"], pad_id)},
        ),
        forward_only=True,
    )
    scores = torch.zeros(n, dtype=torch.float32)
    for chunk, out in zip(chunks, outs, strict=False):  # outputs exist on the last stage only
        scores[torch.as_tensor(chunk, dtype=torch.long)] = out["score"].cpu()
    return broadcast_from_last_stage(scores)
