"""The cheap checks of a run's inputs (model folders, layout, data files), made before launch by
the CLI and again on every rank before any heavy work."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.config import RunConfig
from megarl.parallel import ParallelLayout

if TYPE_CHECKING:
    from megarl.models.dims import ModelDims


def check_inputs(
    cfg: RunConfig, layout: ParallelLayout, this_machine: bool = True
) -> ModelDims | None:
    """Backends (``this_machine``: the run starts here), model folder, layout against it,
    reward model, rollout.env, data files (footers only); returns the reward model's shape (None:
    none)."""
    from megarl.backends import check_backends
    from megarl.data.parquet_source import inspect_files, resolve_files
    from megarl.models.dims import ModelDims

    if this_machine:
        check_backends(cfg)  # vLLM / Transformer Engine where the config asks for them
    dims = ModelDims.from_pretrained(cfg.model.path)
    layout.check_model(dims.shape)
    if cfg.rollout.mode == "async":  # the rollout group's engines: infer_tp ranks each
        p = cfg.parallel
        ParallelLayout(dp=p.rollout_ranks, infer_tp=p.infer_tp or p.tp).check_model(dims.shape)
    _check_moe_options(cfg, dims)
    if cfg.model.critic_path:
        ModelDims.from_pretrained(cfg.model.critic_path)
    reward_model = None
    if cfg.reward.model_path:
        from megarl.rewards.model import check_reward_model

        reward_model = check_reward_model(cfg.reward.model_path, dims.vocab_size)
    if cfg.rollout.env is not None:
        from megarl.envs.loading import check_environment

        check_environment(cfg.rollout.env, cfg.rollout.env_kwargs)
    for files, what in (
        (cfg.data.train_files, "data.train_files"),
        (cfg.data.val_files, "data.val_files"),
    ):
        if files:  # unreadable files fail here
            inspect_files(*resolve_files(files, what=what))
    return reward_model


def _check_moe_options(cfg: RunConfig, dims: ModelDims) -> None:
    """Router-loss settings need a mixture-of-experts model; LoRA needs a dense one."""
    from megarl.errors import ConfigError

    set_ = [n for n in ("moe_aux_loss_coeff", "moe_z_loss_coeff") if getattr(cfg.model, n)]
    if set_ and not dims.is_moe:
        raise ConfigError(
            f"model.{set_[0]}={getattr(cfg.model, set_[0])} applies to mixture-of-experts models; "
            f"{cfg.model.path} is a dense {dims.family} model: remove it (or set it to 0)"
        )
    if cfg.actor.lora.rank and dims.is_moe:
        raise ConfigError(
            f"actor.lora.rank={cfg.actor.lora.rank}: LoRA adapters are built for dense models only "
            f"and {cfg.model.path} is a mixture-of-experts {dims.family} model: set "
            "actor.lora.rank=0 (full fine-tuning)"
        )
