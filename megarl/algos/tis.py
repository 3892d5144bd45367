"""Truncated importance sampling (TIS) for the rollout-vs-trainer mismatch.

The rollout engine (vLLM: other kernels, other precision) and the trainer give the same token
different log-probabilities, so the "on-policy" samples are slightly off-policy for the trainer.
TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training")
reweights each token's policy loss by ``min(pi_train_old / pi_rollout, cap)``: the importance
ratio, truncated from above so a few tokens cannot blow up the gradient variance. The weights are
constants (no gradient). Pass them to ``compute_policy_loss(..., rollout_is_weights=w)``.
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
from megarl.metrics import Reduce

# How compute_tis_weights's metrics combine over ranks (the rest: mean).
TIS_REDUCTIONS = {"mismatch/abs_diff_max": Reduce.MAX, "tis/raw_weight_max": Reduce.MAX}

TIS_LEVELS = ("token", "sequence")
_LOG_RATIO_CLAMP = 20.0


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


def compute_tis_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(weights, metrics)``: truncated importance weights [batch, len] (0 at padding) and the
    mismatch metrics plus ``tis/weight_mean``, ``tis/clip_frac`` (share truncated) and
    ``tis/raw_weight_max``.

    ``level="token"``: ``w_t = min(exp(old_t - rollout_t), cap)``. ``level="sequence"``: one weight
    per sequence, ``min(exp(sum_t (old_t - rollout_t)), cap)``, on each of its tokens.
    """
    check_same_shape(
        old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask
    )
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown TIS level {level!r}; known: {', '.join(TIS_LEVELS)}")
    if not cap > 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    mask = as_bool_mask(response_mask)
    check_finite(mask, old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob)
    with torch.no_grad():
        log_w = zero_masked(old_log_prob - rollout_log_prob, mask)
        if level == "sequence":
            log_w = masked_sum(log_w, mask, dim=-1).unsqueeze(-1).expand_as(log_w)
        raw = torch.exp(torch.clamp(log_w, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        weights = zero_masked(torch.clamp(raw, max=cap), mask)
        if level == "sequence":
            unit_mask = mask.any(dim=-1)
            raw_units = raw[:, 0] if raw.shape[-1] else raw.new_zeros(raw.shape[0])
        else:
            unit_mask, raw_units = mask, raw
        _, raw_max = masked_min_max(raw_units, unit_mask)
        metrics = rollout_mismatch_metrics(old_log_prob, rollout_log_prob, mask)
        metrics.update(
            {
                "tis/weight_mean": masked_mean(weights, mask),
                "tis/clip_frac": masked_mean((raw_units > cap).to(raw.dtype), unit_mask),
                "tis/raw_weight_max": raw_max,
            }
        )
    return weights, metrics
