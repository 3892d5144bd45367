"""Off-policy corrections of the rollout: importance weights of the behaviour policy, by name.

The responses a step trains on were sampled by the rollout engine (the *behaviour* policy): other
kernels and precision than the trainer's (colocated), and in asynchronous mode weights up to
``rollout.placement.max_staleness`` optimizer steps old. The trainer scores the same tokens with its current
weights before the update (``old_log_prob``: the *proximal* policy the PPO ratio is clipped
around). A correction turns the per-token ratio ``rho_t = pi_old(y_t) / pi_rollout(y_t)`` into
weights [batch, len] that multiply the per-token policy loss as constants (no gradient): 0 at
padding and wherever the correction drops a token or a sequence.

``algorithm.rollout_correction`` names one (``none`` turns them off) and
``algorithm.rollout_correction_kwargs`` gives its settings:

=================  ==========================================================================
``token_tis``      truncated IS per token, ``min(rho_t, cap)`` (Yao et al. 2025)
``seq_tis``        truncated IS per sequence, ``min(prod_t rho_t, cap)`` (Liu et al. 2025)
``masked_is``      masked IS: the ratio kept where it lies in ``[low, high]``, else 0, per token or
                   per sequence (Liu et al. 2025's MIS is ``level=sequence, low=0``)
``icepop``         IcePop's two-sided token mask, ``rho_t`` in ``[alpha, beta]`` else 0 (Ling
                   team 2025)
``decoupled_ppo``  decoupled PPO (Hilton et al. 2022; AReaL): the behaviour weight
                   ``pi_prox / pi_behav`` per token, tokens above ``cap`` dropped (None: none)
=================  ==========================================================================

Register another with ``@register_rollout_correction("name")``: a function
``fn(log_ratio, mask, **settings) -> (weights, metrics)`` over the masked log-ratio
``log rho`` (0 at padding, clamped); :func:`compute_rollout_correction` checks the inputs, adds
the mismatch metrics and zeroes the weights at padding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.algos.masked import (
    as_bool_mask,
    check_finite,
    check_same_shape,
    masked_mean,
    masked_min_max,
    masked_sum,
    zero_masked,
)
from megarl.algos.registry import Registry
from megarl.metrics import Reduce

ROLLOUT_CORRECTIONS: Registry = Registry("rollout correction")
register_rollout_correction = ROLLOUT_CORRECTIONS.register

# How compute_rollout_correction's metrics combine over ranks (the rest: mean).
ROLLOUT_CORRECTION_REDUCTIONS = {
    "mismatch/abs_diff_max": Reduce.MAX,
    "correction/raw_weight_max": Reduce.MAX,
    "correction/raw_weight_min": Reduce.MIN,
}

LEVELS = ("token", "sequence")
_LOG_RATIO_CLAMP = 20.0

Result = tuple[Tensor | None, dict[str, Tensor]]


def rollout_mismatch_metrics(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor
) -> dict[str, Tensor]:
    """How far the trainer's log-probs are from the rollout engine's, on the rollout's tokens.

    - ``mismatch/k1``, ``mismatch/k3``: estimates of KL(rollout || trainer) per token
      (samples come from the rollout policy)
    - ``mismatch/abs_diff_mean``, ``mismatch/abs_diff_max``: |log-prob difference| per token
    - ``mismatch/ppl_ratio_mean``: mean over sequences of trainer perplexity / rollout perplexity
    """
    mask = as_bool_mask(response_mask)
    with torch.no_grad():
        d = zero_masked(rollout_log_prob - old_log_prob, mask)  # log(pi_rollout / pi_train)
        log_r = torch.clamp(-d, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        k3 = torch.exp(log_r) - 1.0 - log_r
        _, abs_max = masked_min_max(d.abs(), mask)
        seq_valid = mask.any(dim=-1)
        seq_log_ppl_ratio = masked_mean(d, mask, dim=-1)
        return {
            "mismatch/k1": masked_mean(d, mask),
            "mismatch/k3": masked_mean(k3, mask),
            "mismatch/abs_diff_mean": masked_mean(d.abs(), mask),
            "mismatch/abs_diff_max": abs_max,
            "mismatch/ppl_ratio_mean": masked_mean(torch.exp(seq_log_ppl_ratio), seq_valid),
        }


def _units(log_ratio: Tensor, mask: Tensor, level: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(log_rho per token, log_rho per unit, unit mask)``: a unit is a token, or a sequence
    whose log-ratio (the sum over its tokens) every one of its tokens carries."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; known: {', '.join(LEVELS)}")
    if level == "token":
        return log_ratio, log_ratio, mask
    seq = masked_sum(log_ratio, mask, dim=-1)
    return seq.unsqueeze(-1).expand_as(log_ratio), seq, mask.any(dim=-1)


def _ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(torch.clamp(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def _raw_metrics(raw_units: Tensor, unit_mask: Tensor) -> dict[str, Tensor]:
    lo, hi = masked_min_max(raw_units, unit_mask)
    return {"correction/raw_weight_min": lo, "correction/raw_weight_max": hi}


def _truncated(log_ratio: Tensor, mask: Tensor, cap: float, level: str) -> Result:
    if not cap > 0:
        raise ValueError(f"the truncation cap must be > 0, got {cap}")
    per_token, per_unit, unit_mask = _units(log_ratio, mask, level)
    raw = _ratio(per_token)
    raw_units = _ratio(per_unit)
    metrics = _raw_metrics(raw_units, unit_mask)
    metrics["correction/clip_frac"] = masked_mean((raw_units > cap).to(raw.dtype), unit_mask)
    return torch.clamp(raw, max=cap), metrics


def _masked(log_ratio: Tensor, mask: Tensor, low: float, high: float, level: str) -> Result:
    """The ratio where it lies in ``[low, high]``, 0 elsewhere (per token or per sequence)."""
    if not 0.0 <= low <= high or not high > 0:
        raise ValueError(
            f"the band [low, high] = [{low}, {high}] keeps no ratio: it needs "
            "0 <= low <= high and high > 0 (e.g. low=0.5, high=2.0)"
        )
    per_token, per_unit, unit_mask = _units(log_ratio, mask, level)
    raw = _ratio(per_token)
    raw_units = _ratio(per_unit)
    keep = (raw >= low) & (raw <= high)
    metrics = _raw_metrics(raw_units, unit_mask)
    metrics["correction/mask_frac"] = masked_mean((~keep).to(raw.dtype), mask)
    metrics["correction/masked_low_frac"] = masked_mean((raw_units < low).to(raw.dtype), unit_mask)
    metrics["correction/masked_high_frac"] = masked_mean(
        (raw_units > high).to(raw.dtype), unit_mask
    )
    return torch.where(keep, raw, torch.zeros_like(raw)), metrics


@register_rollout_correction("none")
def no_correction(log_ratio: Tensor, mask: Tensor) -> Result:
    """No importance weights: the rollout's samples are taken as on-policy."""
    return None, {}


@register_rollout_correction("token_tis")
def token_tis(log_ratio: Tensor, mask: Tensor, *, cap: float = 2.0) -> Result:
    """Token-level truncated importance sampling: ``w_t = min(rho_t, cap)``."""
    return _truncated(log_ratio, mask, cap, "token")


@register_rollout_correction("seq_tis")
def seq_tis(log_ratio: Tensor, mask: Tensor, *, cap: float = 2.0) -> Result:
    """Sequence-level truncated importance sampling: every token of sequence i carries
    ``min(prod_t rho_it, cap)``."""
    return _truncated(log_ratio, mask, cap, "sequence")


@register_rollout_correction("masked_is")
def masked_is(
    log_ratio: Tensor,
    mask: Tensor,
    *,
    low: float = 0.0,
    high: float = 2.0,
    level: str = "sequence",
) -> Result:
    """Masked importance sampling: a unit's ratio (token ``rho_t``, or sequence ``prod_t rho_t``)
    where it lies in ``[low, high]``; the units outside the band are dropped (weight 0)."""
    return _masked(log_ratio, mask, low, high, level)


@register_rollout_correction("icepop")
def icepop(log_ratio: Tensor, mask: Tensor, *, alpha: float = 0.5, beta: float = 5.0) -> Result:
    """IcePop: per token ``rho_t`` if ``alpha <= rho_t <= beta``, else 0 (both tails dropped)."""
    return _masked(log_ratio, mask, alpha, beta, "token")


@register_rollout_correction("decoupled_ppo")
def decoupled_ppo(log_ratio: Tensor, mask: Tensor, *, cap: float | None = None) -> Result:
    """Decoupled PPO: the PPO ratio is clipped around the proximal policy (the trainer's
    ``old_log_prob``, scored with its current weights) and each token's loss is weighted by
    ``pi_prox / pi_behav``; a token whose weight exceeds ``cap`` is dropped (None: kept)."""
    if cap is None:
        raw = _ratio(log_ratio)
        metrics = _raw_metrics(raw, mask)
        metrics["correction/mask_frac"] = torch.zeros((), dtype=raw.dtype, device=raw.device)
        return raw, metrics
    return _masked(log_ratio, mask, 0.0, cap, "token")


def compute_rollout_correction(
    name: str,
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    **settings: object,
) -> Result:
    """``(weights, metrics)`` of the named correction: weights [batch, len] (0 at padding; None
    for ``none``), the mismatch metrics and the correction's own (``correction/weight_mean``:
    the mean weight over valid tokens, ``correction/raw_weight_min|max``: the ratio per unit
    before truncation or masking, ``correction/clip_frac`` or ``correction/mask_frac``)."""
    check_same_shape(
        old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask
    )
    mask = as_bool_mask(response_mask)
    check_finite(mask, old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob)
    with torch.no_grad():
        log_ratio = zero_masked(old_log_prob.detach() - rollout_log_prob.detach(), mask)
        weights, own = ROLLOUT_CORRECTIONS.call(name, log_ratio, mask, **settings)
        metrics = rollout_mismatch_metrics(old_log_prob, rollout_log_prob, mask)
        if weights is None:
            return None, metrics
        weights = zero_masked(weights, mask)
        metrics.update(own)
        metrics["correction/weight_mean"] = masked_mean(weights, mask)
    return weights, metrics
