"""Config -> keyword arguments of the registered algorithms, by each function's own signature.

The resolution itself (:func:`megarl.config.algorithm_kwargs`) runs before launch as part of the
config validation; the trainer calls the same function, so what was checked is what runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megarl.algos import AGG_MODES, KL_CONTROLLERS
from megarl.algos.settings import keyword_parameters
from megarl.config import RunConfig, algorithm_kwargs


def policy_loss_kwargs(cfg: RunConfig) -> dict[str, Any]:
    return dict(algorithm_kwargs(cfg).policy_loss)


def advantage_kwargs(cfg: RunConfig) -> dict[str, Any]:
    return dict(algorithm_kwargs(cfg).adv_estimator)


def rollout_correction_kwargs(cfg: RunConfig) -> dict[str, Any]:
    return dict(algorithm_kwargs(cfg).rollout_correction)


def kl_controller_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The settings the configured KL controller (``algorithm.kl_ctrl``) takes."""
    a = cfg.algorithm
    candidates = {"kl_coef": a.kl_coef, "target_kl": a.target_kl, "horizon": a.kl_horizon}
    accepted = keyword_parameters(KL_CONTROLLERS.get(a.kl_ctrl))
    return {k: v for k, v in candidates.items() if k in accepted}


def advantage_inputs(cfg: RunConfig) -> frozenset[str]:
    """Which of ``values`` / ``group_ids`` the configured estimator takes."""
    return algorithm_kwargs(cfg).adv_inputs


def loss_agg_options(cfg: RunConfig) -> Callable[[int], dict[str, Any]]:
    """Options of the loss aggregation for a micro-batch of ``rows`` sequences: ``fn(rows)``.

    Sequence-level modes divide by the micro-batch's row count (padding rows included): the
    trainer weighs each micro-batch by its share of the mini-batch's rows, so the sum over
    micro-batches is the mini-batch's loss whatever the micro-batching.
    """
    static = dict(algorithm_kwargs(cfg).loss_agg)
    per_rows = "num_seqs" in keyword_parameters(AGG_MODES.get(cfg.algorithm.loss_agg_mode))

    def options(rows: int) -> dict[str, Any]:
        return {**static, "num_seqs": rows} if per_rows else dict(static)

    return options
