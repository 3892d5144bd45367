"""KL between the policy and the reference: per-token estimators, coefficient controllers, and the
two ways to use it (a penalty in the reward for PPO, a loss term for GRPO).

Estimators (Schulman, "Approximating KL divergence", 2020), with ``d = log_prob - ref_log_prob``
on tokens sampled from the policy, estimate KL(policy || ref):

- ``k1``: ``d`` (unbiased, high variance, can be negative per token)
- ``abs``: ``|d|``
- ``k2``: ``d^2 / 2`` (biased, low variance; its gradient is the gradient of the true KL)
- ``k3``: ``exp(-d) - 1 + d`` (unbiased, low variance, >= 0); clamped to [-10, 10] because a
  single token with a large ``-d`` makes ``exp`` overflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, TypedDict

import torch
from torch import Tensor

from megarl.algos.aggregation import agg_loss
from megarl.algos.masked import (
    as_bool_mask,
    check_finite,
    check_same_shape,
    masked_mean,
    zero_masked,
)
from megarl.algos.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")
KL_CONTROLLERS: Registry = Registry("KL controller")

K3_CLAMP = 10.0
_LOG_RATIO_CLAMP = 20.0


@KL_ESTIMATORS.register("k1")
def k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("abs")
def kl_abs(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATORS.register("k2")
def k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("k3")
def k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    log_r = torch.clamp(ref_log_prob - log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_r) - log_r - 1.0, -K3_CLAMP, K3_CLAMP)


def kl_penalty(name: str, log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """Per-token KL estimate by the named estimator (no masking, no reduction)."""
    check_same_shape(log_prob=log_prob, ref_log_prob=ref_log_prob)
    return KL_ESTIMATORS.call(name, log_prob, ref_log_prob)


class KLState(TypedDict):
    """A KL controller's checkpointed state."""

    kind: str
    value: float


class KLController(Protocol):
    value: float

    def update(self, current_kl: float | Tensor, n_steps: int) -> None: ...
    def state_dict(self) -> KLState: ...
    def load_state_dict(self, state: KLState) -> None: ...


class _ControllerState:
    kind: str
    value: float

    def state_dict(self) -> KLState:
        return {"kind": self.kind, "value": float(self.value)}

    def load_state_dict(self, state: KLState) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(
                f"KL controller state is for {state.get('kind')!r}, this is {self.kind!r}"
            )
        self.value = float(state["value"])


@KL_CONTROLLERS.register("fixed")
class FixedKLController(_ControllerState):
    """A constant coefficient."""

    kind = "fixed"

    def __init__(self, *, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        del current_kl, n_steps


@KL_CONTROLLERS.register("adaptive")
class AdaptiveKLController(_ControllerState):
    """Proportional control of the coefficient toward ``target_kl`` (Ziegler et al. 2019, sec 2.2).

    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``,
    where ``n_steps`` is the number of samples the KL was measured over.
    """

    kind = "adaptive"

    def __init__(self, *, kl_coef: float, target_kl: float, horizon: int) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        current = float(current_kl)
        if current != current:  # NaN
            raise ValueError("AdaptiveKLController.update got current_kl = NaN")
        error = min(max(current / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(kind: str, **hparams: object) -> KLController:
    """``make_kl_controller("fixed", kl_coef=0.001)`` or
    ``make_kl_controller("adaptive", kl_coef=0.2, target_kl=6.0, horizon=10000)``."""
    return KL_CONTROLLERS.call(kind, **hparams)


def apply_kl_in_reward(
    token_level_scores: Tensor,
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[Tensor, dict[str, Tensor]]:
    """``rewards = scores - kl_coef * KL`` per token (the PPO-RLHF reward of Ziegler et al.).

    Pure: returns the rewards and ``metrics["kl"]``, the batch mean of the per-sequence mean KL;
    feed that (averaged over data-parallel ranks) to ``controller.update(kl, n_steps=batch)``
    and pass ``controller.value`` as ``kl_coef``.
    """
    check_same_shape(
        token_level_scores=token_level_scores,
        log_prob=log_prob,
        ref_log_prob=ref_log_prob,
        response_mask=response_mask,
    )
    mask = as_bool_mask(response_mask)
    check_finite(
        mask, log_prob=log_prob, ref_log_prob=ref_log_prob, token_level_scores=token_level_scores
    )
    kld = zero_masked(
        kl_penalty(estimator, zero_masked(log_prob, mask), zero_masked(ref_log_prob, mask)), mask
    )
    rewards = zero_masked(token_level_scores, mask) - kl_coef * kld
    seq_kl = masked_mean(kld, mask, dim=-1)
    seq_valid = mask.any(dim=-1)
    current = masked_mean(seq_kl, seq_valid)
    return rewards, {
        "kl": current.detach(),
        "kl_coef": torch.tensor(float(kl_coef), dtype=rewards.dtype, device=rewards.device),
    }


def kl_loss(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    *,
    kl_coef: float,
    estimator: str = "k3",
    loss_agg_mode: str = "token-mean",
    loss_agg_kwargs: Mapping[str, object] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL as a loss term (GRPO): ``kl_coef * agg(KL per token)``, with ``metrics["kl_loss"]`` the
    un-scaled KL. Gradients flow to ``log_prob`` only (the reference is a constant)."""
    check_same_shape(log_prob=log_prob, ref_log_prob=ref_log_prob, response_mask=response_mask)
    mask = as_bool_mask(response_mask)
    check_finite(mask, log_prob=log_prob, ref_log_prob=ref_log_prob)
    kld = kl_penalty(
        estimator, zero_masked(log_prob, mask), zero_masked(ref_log_prob.detach(), mask)
    )
    kl = agg_loss(kld, mask, loss_agg_mode, **dict(loss_agg_kwargs or {}))
    coef = torch.tensor(float(kl_coef), dtype=kl.dtype, device=kl.device)
    return kl_coef * kl, {"kl_loss": kl.detach(), "kl_coef": coef}
