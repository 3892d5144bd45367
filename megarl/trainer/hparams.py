"""Config -> keyword arguments of a registered algorithm, by the function's own signature.

Registered losses and estimators accept only the hyperparameters they use (an unknown one is a
TypeError), so the trainer passes each the subset of the config it names; a user-registered
function gets its settings the same way, with no branch per algorithm name.
"""

from __future__ import annotations

import inspect
from typing import Any

from megarl.algos import ADV_ESTIMATORS, KL_CONTROLLERS, POLICY_LOSSES
from megarl.config import AlgorithmConfig


def _candidates(cfg: AlgorithmConfig) -> dict[str, Any]:
    return {
        "gamma": cfg.gamma,
        "lam": cfg.lam,
        "norm_by_std": cfg.norm_adv_by_std,
        "clip_ratio_low": cfg.clip_ratio_low,
        "clip_ratio_high": cfg.clip_ratio_high,
        "clip_ratio_c": cfg.clip_ratio_c,
    }


def _accepted(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def policy_loss_kwargs(cfg: AlgorithmConfig) -> dict[str, Any]:
    accepted = _accepted(POLICY_LOSSES.get(cfg.policy_loss))
    return {k: v for k, v in _candidates(cfg).items() if k in accepted}


def advantage_kwargs(cfg: AlgorithmConfig) -> dict[str, Any]:
    accepted = _accepted(ADV_ESTIMATORS.get(cfg.adv_estimator))
    return {k: v for k, v in _candidates(cfg).items() if k in accepted}


def kl_controller_kwargs(cfg: AlgorithmConfig) -> dict[str, Any]:
    """The settings the configured KL controller (``algorithm.kl_ctrl``) takes."""
    candidates = {"kl_coef": cfg.kl_coef, "target_kl": cfg.target_kl, "horizon": cfg.kl_horizon}
    accepted = _accepted(KL_CONTROLLERS.get(cfg.kl_ctrl))
    return {k: v for k, v in candidates.items() if k in accepted}


def advantage_inputs(cfg: AlgorithmConfig) -> set[str]:
    """Which of ``values`` / ``group_ids`` the configured estimator takes."""
    return _accepted(ADV_ESTIMATORS.get(cfg.adv_estimator)) & {"values", "group_ids"}
