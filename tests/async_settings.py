"""The rollout group's settings of a test's run config, as ``serve_rollouts`` builds them (on
the CPU: the rollout's dtype as it resolves there)."""

from __future__ import annotations

from megarl.config import RunConfig, rollout_dtype
from megarl.dtypes import dtype_from_name
from megarl.trainer.rollout_group_parts import GroupSettings


def group_settings(cfg: RunConfig) -> GroupSettings:
    return GroupSettings(
        cfg.rollout.placement,
        cfg.rollout.environment.max_env_failures,
        cfg.data,
        cfg.trainer,
        cfg.algorithm.filter_groups,
        dtype_from_name(rollout_dtype(cfg.model, cfg.rollout.engine, False)),
    )
