"""Policy-gradient losses, registered by name.

A policy loss is one function ``fn(old_log_prob, log_prob, advantages, mask, **hparams)`` that
returns ``(loss_mat, metrics)``: the per-token loss matrix and detached scalar tensors. Everything
common — input checks, masking of padding, the optional rollout importance weights and the
aggregation to one number — is done once by :func:`compute_policy_loss`, so a new loss is one
function and one config word::

    @register_policy_loss("my_loss")
    def my_loss(old_log_prob, log_prob, advantages, mask, *, beta: float = 0.1): ...
"""

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
    masked_min_max,
    zero_masked,
)
from megarl.algos.registry import Registry
from megarl.metrics import Reduce

POLICY_LOSSES: Registry = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register

# How compute_policy_loss's metrics combine over ranks and micro-batches' ranks (the rest: mean).
POLICY_LOSS_REDUCTIONS = {"ratio_min": Reduce.MIN, "ratio_max": Reduce.MAX}

# exp() of a log-ratio beyond this is an overflow in fp32, not a policy-gradient signal.
LOG_RATIO_CLAMP = 20.0


def _ratio_metrics(ratio: Tensor, log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    rmin, rmax = masked_min_max(ratio, mask)
    return {
        # k1 estimate of KL(old || new) on tokens sampled from the old policy.
        "ppo_kl": masked_mean(-log_ratio.detach(), mask),
        "ratio_mean": masked_mean(ratio.detach(), mask),
        "ratio_min": rmin,
        "ratio_max": rmax,
    }


def _check_clip(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")


@register_policy_loss("ppo_clip")
def ppo_clip(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017), asymmetric clip range, optional dual clip.

    Per token, with ``r = exp(log_prob - old_log_prob)``:
    ``max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``. Dual clip (Ye et al.
    2020): for ``A < 0`` the loss is further capped at ``clip_ratio_c * |A|``, so a token whose
    ratio exploded cannot dominate the batch. ``clip_ratio_c=None`` turns dual clip off.
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (or None to disable), got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"pg_clipfrac": masked_mean((clipped > unclipped).to(loss.dtype), mask)}
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        negative = advantages < 0
        metrics["pg_clipfrac_lower"] = masked_mean((negative & (loss > cap)).to(loss.dtype), mask)
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    metrics.update(_ratio_metrics(ratio, log_ratio, mask))
    return loss, metrics


@register_policy_loss("gspo")
def gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025), token form ("GSPO-token").

    The importance ratio is per sequence: ``s_i = exp(mean_t (log_prob - old_log_prob))`` over the
    sequence's valid tokens, clipped like PPO (the paper's ranges are tiny: 3e-4 / 4e-4). Per token
    the ratio is ``sg[s_i] * exp(log_prob_t - sg[log_prob_t])``: equal to ``s_i`` in value, and
    with ``seq-mean-token-mean`` aggregation and a per-sequence advantage its gradient is exactly
    the sequence-level GSPO gradient. Use ``loss_agg_mode="seq-mean-token-mean"`` for the paper.
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    seq_log_ratio = masked_mean(log_prob - old_log_prob, mask, dim=-1)  # [batch]
    log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    log_ratio = torch.clamp(log_ratio, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"pg_clipfrac": masked_mean((clipped > unclipped).to(loss.dtype), mask)}
    seq_mask = as_bool_mask(mask).any(dim=-1)
    seq_ratio = torch.exp(seq_log_ratio.detach())
    smin, smax = masked_min_max(seq_ratio, seq_mask)
    metrics.update(
        ppo_kl=masked_mean(-(log_prob - old_log_prob).detach(), mask),
        ratio_mean=masked_mean(seq_ratio, seq_mask),
        ratio_min=smin,
        ratio_max=smax,
    )
    return loss, metrics


def compute_policy_loss(
    name: str,
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    loss_agg_kwargs: Mapping[str, object] | None = None,
    rollout_is_weights: Tensor | None = None,
    **hparams: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The named policy loss, aggregated to one scalar, and its metrics.

    All tensors are [batch, response_len]. Padding (mask 0) may hold anything, NaN included; a
    NaN or inf at a valid position raises ValueError naming the tensor. ``rollout_is_weights``
    (e.g. from :func:`megarl.algos.rollout_correction.compute_rollout_correction`) multiply the
    per-token loss, as a constant. ``hparams`` go to the loss itself; an unknown one raises
    TypeError.
    """
    check_same_shape(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    mask = as_bool_mask(response_mask)
    check_finite(
        mask,
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        rollout_is_weights=rollout_is_weights,
    )
    loss_mat, metrics = POLICY_LOSSES.call(
        name,
        zero_masked(old_log_prob.detach(), mask),
        zero_masked(log_prob, mask),
        zero_masked(advantages.detach(), mask),
        mask,
        **hparams,
    )
    if rollout_is_weights is not None:
        loss_mat = loss_mat * zero_masked(rollout_is_weights.detach(), mask)
    loss = agg_loss(loss_mat, mask, loss_agg_mode, **dict(loss_agg_kwargs or {}))
    return loss, metrics
