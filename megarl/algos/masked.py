"""Reductions over the valid (mask == 1) entries of a tensor, and input checks shared by the losses.

Masked-out entries never reach the arithmetic: they are replaced by zeros with ``torch.where``
before anything else happens, so a NaN or inf sitting in padding can neither leak into a result
nor into a gradient (``x * mask`` would give ``NaN * 0 = NaN``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# Sums a statistic over the whole batch: this process's batch (``local_sum``), or every
# data-parallel rank's (the trainer passes an all-reduce), so a batch-wide statistic is the
# same whatever the layout.
BatchSum = Callable[[Tensor], Tensor]


def local_sum(t: Tensor) -> Tensor:
    """The batch is this process's: nothing to add."""
    return t


def as_bool_mask(mask: Tensor) -> Tensor:
    """A bool view of a 0/1 mask of any dtype (bool, int, float)."""
    return mask if mask.dtype == torch.bool else mask != 0


def zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with every masked-out entry replaced by 0 (gradient 0 there, even if ``x`` was NaN)."""
    return torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    if dim is None:
        return zero_masked(x, mask).sum()
    return zero_masked(x, mask).sum(dim=dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    m = as_bool_mask(mask)
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of the valid entries; 0 where there is no valid entry (not NaN), gradient 0 there."""
    count = masked_count(mask, dim).to(x.dtype)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of all valid entries (one number). Unbiased needs at least 2 of them."""
    n = int(masked_count(mask))
    need = 2 if unbiased else 1
    if n < need:
        raise ValueError(
            f"masked_var needs at least {need} valid entries (unbiased={unbiased}), got {n}"
        )
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    return sq / (n - 1 if unbiased else n)


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    batch_sum: BatchSum = local_sum,
) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over all valid entries of the batch (``batch_sum`` adds
    the other ranks' sums); masked-out entries come back 0.

    With ``shift_mean=False`` the mean is added back (only the scale is normalised). Uses the
    unbiased variance, so it raises ValueError for fewer than 2 valid entries in the batch.
    """
    sums = batch_sum(torch.stack([masked_sum(x, mask), masked_count(mask).to(x.dtype)]))
    n = int(sums[1])
    if n < 2:
        raise ValueError(f"masked_whiten needs at least 2 valid entries in the batch, got {n}")
    mean = sums[0] / sums[1]
    var = batch_sum(masked_sum((x - mean) ** 2, mask)) / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return zero_masked(out, mask)


def masked_min_max(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(min, max) of the valid entries; (0, 0) when there is none. Not differentiable (metrics)."""
    m = as_bool_mask(mask)
    if not bool(m.any()):
        z = torch.zeros((), dtype=x.dtype, device=x.device)
        return z, z
    vals = x.detach()[m]
    return vals.min(), vals.max()


def check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


def check_finite(mask: Tensor, **tensors: Tensor | None) -> None:
    """ValueError if a tensor holds NaN or +-inf at a valid position (padding may hold anything).

    One device sync for all the tensors together; it is the price of an error that names the
    tensor instead of a NaN loss three steps later. ``None`` entries are skipped.
    """
    m = as_bool_mask(mask)
    named = [(name, t.detach()) for name, t in tensors.items() if t is not None]
    if not named:
        return
    bad_any = torch.stack([(~torch.isfinite(t) & m).any() for _, t in named])
    if not bool(bad_any.any()):
        return
    for name, t in named:
        bad = ~torch.isfinite(t) & m
        if bool(bad.any()):
            first = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} holds {int(bad.sum())} non-finite value(s) at unmasked positions "
                f"(first at index {first}: {t[first].item()})"
            )
