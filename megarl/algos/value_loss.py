"""Critic loss with value clipping, and the entropy terms of the actor loss."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from megarl.algos.aggregation import agg_loss
from megarl.algos.masked import (
    as_bool_mask,
    check_finite,
    check_same_shape,
    masked_mean,
    masked_var,
    zero_masked,
)


def compute_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    loss_agg_kwargs: Mapping[str, object] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (PPO2 style): ``0.5 * max((V - R)^2, (V_clip - R)^2)`` per token.

    ``V_clip = old_V + clamp(V - old_V, -cliprange_value, cliprange_value)`` keeps one update from
    moving a value estimate far from where the rollout saw it. ``cliprange_value=None`` disables
    clipping (plain 0.5 MSE). Metrics: ``vf_clipfrac`` (share of tokens where the clipped term is
    the larger one) and ``vpred_mean``.
    """
    check_same_shape(
        values=values, old_values=old_values, returns=returns, response_mask=response_mask
    )
    if cliprange_value is not None and cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0 or None, got {cliprange_value}")
    mask = as_bool_mask(response_mask)
    check_finite(mask, values=values, old_values=old_values, returns=returns)
    values = zero_masked(values, mask)
    old_values = zero_masked(old_values.detach(), mask)
    returns = zero_masked(returns.detach(), mask)
    unclipped = (values - returns).square()
    if cliprange_value is None:
        loss_mat = 0.5 * unclipped
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
        clipped = (v_clipped - returns).square()
        loss_mat = 0.5 * torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), mask)
    loss = agg_loss(loss_mat, mask, loss_agg_mode, **dict(loss_agg_kwargs or {}))
    return loss, {"vf_clipfrac": clipfrac, "vpred_mean": masked_mean(values.detach(), mask)}


def compute_entropy_loss(
    entropy: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    loss_agg_kwargs: Mapping[str, object] | None = None,
) -> Tensor:
    """Aggregated entropy of the policy over the valid tokens (a quantity, not yet a loss sign)."""
    check_same_shape(entropy=entropy, response_mask=response_mask)
    mask = as_bool_mask(response_mask)
    check_finite(mask, entropy=entropy)
    return agg_loss(zero_masked(entropy, mask), mask, loss_agg_mode, **dict(loss_agg_kwargs or {}))


def entropy_bonus(
    entropy: Tensor,
    response_mask: Tensor,
    *,
    entropy_coef: float,
    loss_agg_mode: str = "token-mean",
    loss_agg_kwargs: Mapping[str, object] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The term to add to the actor loss: ``-entropy_coef * agg(entropy)`` (minimising it raises
    entropy), and ``metrics["entropy"]`` = the aggregated entropy."""
    h = compute_entropy_loss(entropy, response_mask, loss_agg_mode, loss_agg_kwargs)
    return -entropy_coef * h, {"entropy": h.detach()}


def explained_variance(values: Tensor, returns: Tensor, response_mask: Tensor) -> Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over the valid tokens: 1 when the critic
    predicts the returns exactly, 0 when it is no better than their mean, negative when worse.
    NaN when the returns do not vary."""
    check_same_shape(values=values, returns=returns, response_mask=response_mask)
    mask = as_bool_mask(response_mask)
    if int(mask.sum()) < 2:
        return torch.tensor(float("nan"), device=values.device)
    with torch.no_grad():
        var_returns = masked_var(returns, mask)
        var_residual = masked_var(returns - values, mask)
        return 1.0 - var_residual / var_returns


def explained_variance_sums(values: Tensor, returns: Tensor, response_mask: Tensor) -> Tensor:
    """The float64 sums ``[n, sum R, sum R^2, sum D, sum D^2]`` (``D = R - V``) over the valid
    tokens, from which :func:`explained_variance_from_sums` gives the explained variance. Sums
    add up over data-parallel ranks, so the whole batch's explained variance is that of the
    summed sums, not a mean of per-rank ratios."""
    check_same_shape(values=values, returns=returns, response_mask=response_mask)
    mask = as_bool_mask(response_mask)
    with torch.no_grad():
        r = returns[mask].double()
        d = r - values[mask].double()
        return torch.stack(
            [r.new_tensor(float(r.numel())), r.sum(), r.square().sum(), d.sum(), d.square().sum()]
        )


def explained_variance_from_sums(sums: Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` from :func:`explained_variance_sums` (of one rank or summed
    over ranks); NaN with fewer than 2 tokens or returns that do not vary."""
    n, sum_r, sum_r2, sum_d, sum_d2 = (float(x) for x in sums.tolist())
    if n < 2:
        return float("nan")
    var_r = sum_r2 / n - (sum_r / n) ** 2
    var_d = sum_d2 / n - (sum_d / n) ** 2
    if var_r <= 0.0:
        return float("nan")
    return 1.0 - var_d / var_r
