"""A config's algorithm words resolved once into the settings of the registered functions.

Before any process starts the launcher resolves the trainer's words with ``try_them``/``try_it``
(an unknown name lists the known ones, a setting the chosen function does not take names the fix);
each rank's trainer then resolves the same sections once (:func:`resolve_algorithm_kwargs` for
PPO/GRPO, :func:`resolve_dpo_loss` for DPO) and passes the result down, so what was checked is what
runs. Both take the config sections they read, never the whole run config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarl.algos.advantages import ADV_ESTIMATORS
from megarl.algos.aggregation import AGG_MODES
from megarl.algos.dpo import DPO_LOSSES, needs_reference, try_dpo_loss
from megarl.algos.kl import KL_CONTROLLERS, KL_ESTIMATORS
from megarl.algos.policy_loss import POLICY_LOSSES
from megarl.algos.rollout_correction import ROLLOUT_CORRECTIONS, compute_rollout_correction
from megarl.algos.settings import (
    Choice,
    SettingError,
    keyword_parameters,
    lookup,
    positional_inputs,
    resolve_kwargs,
    try_call,
    try_on_tiny_batch,
)
from megarl.config import AlgorithmConfig, DPOConfig, SamplingSettings
from megarl.errors import ConfigError


@dataclass(frozen=True)
class AlgorithmKwargs:
    """The configured PPO/GRPO algorithms' keyword arguments, resolved against their signatures."""

    policy_loss: dict[str, Any]
    adv_estimator: dict[str, Any]
    loss_agg: dict[str, Any]  # static options of the loss aggregation mode (e.g. norm_length)
    loss_agg_per_rows: bool  # the aggregation divides by the micro-batch's rows (num_seqs)
    adv_inputs: frozenset[str]  # which of values / group_ids the estimator takes
    rollout_correction: dict[str, Any]  # settings of algorithm.rollout_correction
    kl_controller: dict[str, float]  # settings algorithm.kl_ctrl takes


@dataclass(frozen=True)
class DPOLoss:
    """The configured DPO loss: its settings and whether it compares against a reference."""

    kwargs: dict[str, Any]
    needs_reference: bool


def _named(a: AlgorithmConfig, *pairs: tuple[str, str]) -> dict[str, tuple[str, Any]]:
    return {param: (f"algorithm.{key}", getattr(a, key)) for key, param in pairs}


def _policy_choices(a: AlgorithmConfig) -> tuple[Choice, Choice, Choice, Choice]:
    """The policy loss, advantage estimator, loss aggregation and rollout correction choices."""
    policy = Choice(
        "algorithm.policy_loss",
        POLICY_LOSSES,
        a.policy_loss,
        _named(
            a,
            ("clip_ratio_low", "clip_ratio_low"),
            ("clip_ratio_high", "clip_ratio_high"),
            ("clip_ratio_c", "clip_ratio_c"),
        ),
        dict(a.policy_loss_kwargs),
        "algorithm.policy_loss_kwargs",
    )
    estimator = Choice(
        "algorithm.adv_estimator",
        ADV_ESTIMATORS,
        a.adv_estimator,
        _named(a, ("gamma", "gamma"), ("lam", "lam"), ("norm_adv_by_std", "norm_by_std")),
        dict(a.adv_estimator_kwargs),
        "algorithm.adv_estimator_kwargs",
    )
    agg = Choice(
        "algorithm.loss_agg_mode",
        AGG_MODES,
        a.loss_agg_mode,
        _named(a, ("loss_agg_norm_length", "norm_length")),
        supplied=frozenset({"num_tokens", "num_seqs"}),
    )
    correction = Choice(
        "algorithm.rollout_correction",
        ROLLOUT_CORRECTIONS,
        a.rollout_correction,
        open=dict(a.rollout_correction_kwargs),
        open_setting="algorithm.rollout_correction_kwargs",
    )
    return policy, estimator, agg, correction


def _kl_controller_kwargs(a: AlgorithmConfig) -> dict[str, float]:
    lookup(Choice("algorithm.kl_ctrl", KL_CONTROLLERS, a.kl_ctrl))
    candidates = {"kl_coef": a.kl_coef, "target_kl": a.target_kl, "horizon": a.kl_horizon}
    accepted = keyword_parameters(KL_CONTROLLERS.get(a.kl_ctrl))
    return {k: v for k, v in candidates.items() if k in accepted}


def resolve_algorithm_kwargs(
    a: AlgorithmConfig, sampling: SamplingSettings, try_them: bool = False
) -> AlgorithmKwargs:
    """Resolve every choice of the ``algorithm`` section through its registry; ConfigError naming
    the fix for an unknown name or a setting the chosen function does not take. ``sampling`` gives
    the response budget (a length-normalised loss's default) and the samples per prompt.
    ``try_them`` also calls the chosen policy loss, estimator and rollout correction once on a
    tiny batch (a value they refuse fails here)."""
    policy, estimator, agg, correction = _policy_choices(a)
    try:
        for key in ("kl_loss_estimator", "kl_in_reward_estimator"):
            lookup(Choice(f"algorithm.{key}", KL_ESTIMATORS, getattr(a, key)))
        kl_controller = _kl_controller_kwargs(a)
        loss_agg = resolve_kwargs(agg)
        agg_params = keyword_parameters(lookup(agg))
        if "norm_length" in agg_params and "norm_length" not in loss_agg:
            loss_agg["norm_length"] = sampling.max_response_length
        out = AlgorithmKwargs(
            policy_loss=resolve_kwargs(policy),
            adv_estimator=resolve_kwargs(estimator),
            loss_agg=loss_agg,
            loss_agg_per_rows="num_seqs" in agg_params,
            adv_inputs=frozenset(
                positional_inputs(lookup(estimator)) & {"values", "group_ids", "batch_sum"}
            ),
            rollout_correction=resolve_kwargs(correction),
            kl_controller=kl_controller,
        )
        if try_them:
            try_on_tiny_batch(policy, out.policy_loss, estimator, out.adv_estimator)
            try_call(correction, lambda: _try_correction(a.rollout_correction, out))
    except SettingError as e:
        raise ConfigError(str(e)) from None
    if "group_ids" in out.adv_inputs and sampling.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator!r} compares the samples of a prompt with "
            f"each other, so rollout.sampling.n={sampling.n} gives every sample advantage 0; set "
            "rollout.sampling.n >= 2, or adv_estimator=gae (with a critic) / reinforce_plus_plus"
        )
    return out


def _try_correction(name: str, kwargs: AlgorithmKwargs) -> None:
    """The configured rollout correction on a 2 x 2 batch (an empty band fails here)."""
    zeros = torch.zeros(2, 2)
    compute_rollout_correction(name, zeros, zeros, torch.ones(2, 2), **kwargs.rollout_correction)


def resolve_dpo_loss(d: DPOConfig, try_it: bool = False) -> DPOLoss:
    """The configured DPO loss (``dpo.loss`` with ``dpo.beta`` and ``dpo.loss_kwargs``), resolved
    against its signature; ConfigError naming the fix for an unknown loss or setting, or for a
    reference given to a reference-free loss. ``try_it`` also calls it once on a tiny batch."""
    choice = Choice(
        "dpo.loss",
        DPO_LOSSES,
        d.loss,
        {"beta": ("dpo.beta", d.beta)},
        dict(d.loss_kwargs),
        "dpo.loss_kwargs",
    )
    try:
        kwargs = resolve_kwargs(choice)
        if try_it:
            try_dpo_loss(d.loss, kwargs)
    except SettingError as e:
        raise ConfigError(str(e)) from None
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"dpo.loss={d.loss!r} refuses its settings (dpo.beta, dpo.loss_kwargs): {e}"
        ) from None
    loss = DPOLoss(kwargs, needs_reference(DPO_LOSSES.get(d.loss)))
    if d.reference_path is not None and not loss.needs_reference:
        raise ConfigError(
            f"dpo.reference_path={d.reference_path} is set but dpo.loss={d.loss!r} is "
            "reference-free; remove dpo.reference_path, or choose a loss that uses a reference "
            "(e.g. sigmoid)"
        )
    return loss
