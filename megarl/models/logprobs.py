"""Teacher-forced logprobs of given tokens, the one path used by the rollout scoring of the hybrid
engine and by the trainer (old, reference and current logprobs).

Sequences are right padded ``[b, L]``; position ``p`` predicts token ``p + 1``. Callers pick the
positions whose outputs they need (``[b, P]``, usually a response: ``start - 1 + j``), the output
layer projects only those (:func:`megarl.models.forward.output_positions`), and the
logprobs are computed chunk by chunk on the vocabulary shard, without a gathered ``[b, P, V]``.
"""

from __future__ import annotations

import torch

from megarl import parallel
from megarl.algos import vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy
from megarl.models.forward import broadcast_from_last_stage, run_schedule


def pad_right(sequences: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """``[N, max_len]`` token ids on ``device``, each sequence left-aligned and padded with
    ``pad_id``."""
    length = max(len(s) for s in sequences)
    rows = [list(s) + [pad_id] * (length - len(s)) for s in sequences]
    return torch.tensor(rows, dtype=torch.long, device=device)


def positions_from(starts: torch.Tensor, width: int, seq_len: int) -> torch.Tensor:
    """``[b, width]`` positions ``starts[i] + j``; past the sequence they repeat its last position
    (their values are garbage for the caller to mask or drop)."""
    return (starts.unsqueeze(1) + torch.arange(width, device=starts.device)).clamp(max=seq_len - 1)


def targets_at(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The token each position predicts (``input_ids[p + 1]``, clamped to the last column)."""
    return input_ids.gather(1, (positions + 1).clamp(max=input_ids.shape[1] - 1))


def log_probs_at(
    logits_shard: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    vocab_size: int,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[b, P]`` logprobs (and entropies) of the targets of ``positions`` from vocab-parallel
    logits computed at those positions (``[b, P, vocab/tp]``), under ``softmax(logits /
    temperature)``: the distribution a rollout at that temperature sampled from."""
    if temperature != 1.0:  # a new tensor: the gradient flows through it to the logits
        logits_shard = logits_shard / temperature
    targets = targets_at(input_ids, positions).to(logits_shard.device)
    group = parallel.tp_group_if_split()
    if with_entropy:
        return vocab_parallel_log_probs_and_entropy(
            logits_shard, targets, group, vocab_size=vocab_size
        )
    return vocab_parallel_log_probs(logits_shard, targets, group, vocab_size=vocab_size), None


@torch.no_grad()
def teacher_forced_log_probs(
    model,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[b, P]`` logprobs at ``positions`` (of ``softmax(logits / temperature)``) in one
    forward-only pass through the pipeline, the same tensor on every stage (collective over TP
    and PP). With ``seq_lens`` (the rows' real lengths) the batch runs as one pack
    (:mod:`megarl.models.packing`)."""
    device = next(model.parameters()).device

    def logprobs(logits_shard: torch.Tensor, batch):
        # targets are gathered where ids and positions live, then moved to the logits' device
        logp, _ = log_probs_at(
            logits_shard, input_ids, positions, vocab_size, temperature=temperature
        )
        return logits_shard.new_zeros(()), {"logp": logp.float()}

    batch = {"input_ids": input_ids.to(device), "positions": positions.to(device)}
    if seq_lens is not None:
        batch["seq_lens"] = seq_lens.to(device)
    outs = run_schedule(
        [model],
        [batch],
        logprobs,
        forward_only=True,
    )
    out = outs[0]["logp"] if outs else torch.zeros(positions.shape, device=device)
    return broadcast_from_last_stage(out.contiguous())
