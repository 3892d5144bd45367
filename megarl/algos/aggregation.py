"""How a [batch, response_len] matrix of per-token losses becomes one number.

The modes differ in how much each token weighs:

- ``token-mean``: every valid token weighs the same (long answers weigh more in total).
- ``seq-mean-token-sum``: sum within a sequence, mean over sequences.
- ``seq-mean-token-mean``: mean within a sequence, mean over sequences (the original GRPO: each
  sequence weighs the same, so a token of a long answer weighs less).
- ``seq-mean-token-sum-norm``: sum within a sequence divided by a constant ``norm_length``
  (default: the padded response length), mean over sequences (Dr. GRPO, Liu et al. 2025: no
  length-dependent normaliser, hence no length bias).

Sequences without any valid token are left out of the "mean over sequences". When one batch is
split into micro-batches (or data-parallel ranks) and the per-micro-batch losses are summed, pass
the global denominators (``num_tokens`` / ``num_seqs``) so the sum equals the loss of the whole
batch; otherwise each micro-batch is normalised by its own counts.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
from torch import Tensor

from megarl.algos.masked import as_bool_mask, check_same_shape, masked_count, masked_sum
from megarl.algos.registry import Registry

AGG_MODES: Registry = Registry("loss aggregation mode")

Number: TypeAlias = float | int | Tensor


def _seq_denominator(mask: Tensor, num_seqs: Number | None, dtype: torch.dtype) -> Tensor:
    if num_seqs is not None:
        return torch.as_tensor(num_seqs, dtype=dtype, device=mask.device)
    return as_bool_mask(mask).any(dim=-1).sum().to(dtype).clamp(min=1)


@AGG_MODES.register("token-mean")
def token_mean(loss_mat: Tensor, mask: Tensor, *, num_tokens: Number | None = None) -> Tensor:
    total = masked_sum(loss_mat, mask)
    if num_tokens is None:
        return total / masked_count(mask).to(loss_mat.dtype).clamp(min=1)
    return total / num_tokens


@AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, *, num_seqs: Number | None = None) -> Tensor:
    per_seq = masked_sum(loss_mat, mask, dim=-1)
    return per_seq.sum() / _seq_denominator(mask, num_seqs, loss_mat.dtype)


@AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_mat: Tensor, mask: Tensor, *, num_seqs: Number | None = None
) -> Tensor:
    lengths = masked_count(mask, dim=-1).to(loss_mat.dtype)
    per_seq = masked_sum(loss_mat, mask, dim=-1) / lengths.clamp(min=1)
    return per_seq.sum() / _seq_denominator(mask, num_seqs, loss_mat.dtype)


@AGG_MODES.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_mat: Tensor,
    mask: Tensor,
    *,
    norm_length: Number | None = None,
    num_seqs: Number | None = None,
) -> Tensor:
    norm = loss_mat.shape[-1] if norm_length is None else norm_length
    per_seq = masked_sum(loss_mat, mask, dim=-1) / norm
    return per_seq.sum() / _seq_denominator(mask, num_seqs, loss_mat.dtype)


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", **kw: object) -> Tensor:
    """Aggregate per-token losses with the named mode; ``kw`` are that mode's options."""
    check_same_shape(loss_mat=loss_mat, mask=mask)
    return AGG_MODES.call(mode, loss_mat, mask, **kw)
