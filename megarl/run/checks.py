"""The cheap checks of a run's inputs (model folders, layout, data files), made before launch by
the CLI and again on every rank before any heavy work."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.config import RunConfig
from megarl.errors import ConfigError
from megarl.import_paths import check_import_path
from megarl.parallel import ParallelLayout

if TYPE_CHECKING:
    from megarl.data.parquet_source import ParquetFileInfo
    from megarl.models.dims import ModelDims


# Settings that name Python code, with the keyword arguments megarl calls it with: each is
# imported and checked (check_import_path) before any model is built. Add yours here.
IMPORT_SETTINGS: dict[str, tuple[str, ...]] = {
    "reward.custom_fn": ("data_source", "solution_str", "ground_truth", "extra_info"),
}


def setting_value(cfg: RunConfig, key: str) -> object:
    """The value of a dotted config key (``reward.custom_fn``) in ``cfg``."""
    value: object = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def check_import_settings(cfg: RunConfig) -> None:
    """Import every path of :data:`IMPORT_SETTINGS` that ``cfg`` sets, and check its signature."""
    for key, keywords in IMPORT_SETTINGS.items():
        spec = setting_value(cfg, key)
        if spec:
            check_import_path(key, str(spec), keywords)


def rules_need_ground_truth(cfg: RunConfig) -> bool:
    """Whether the run's rule scorers read each prompt's ``reward_model.ground_truth``: the
    built-in scorers do; a ``reward.custom_fn`` gets it if present; a reward model alone never."""
    return cfg.reward.rule_weight != 0 and cfg.reward.custom_fn is None


def check_reward_columns(cfg: RunConfig, files: list[ParquetFileInfo], fs, what: str) -> None:
    """The prompt files carry what the chosen scorers need: with the built-in scorers, verl's
    ``reward_model`` column (with ``ground_truth``) and only data sources they know."""
    if cfg.trainer.kind != "policy" or not rules_need_ground_truth(cfg):
        return
    from megarl.data.parquet_source import distinct_strings
    from megarl.data.schema import REWARD_MODEL, STRING, check_columns
    from megarl.rewards.registry import BUILTIN_SCORERS

    why = (
        "The built-in rule scorers read each prompt's reward_model.ground_truth (no "
        "reward.custom_fn is set). Add the column (python scripts/prepare_gsm8k.py writes it), "
        "set reward.custom_fn to your scorer, or score with a reward model alone "
        "(reward.model_path=..., reward.rule_weight=0)."
    )
    for info in files:
        check_columns(info, {"data_source": STRING, "reward_model": REWARD_MODEL}, hint=why)
        unknown = sorted(distinct_strings(fs, info, "data_source") - set(BUILTIN_SCORERS))
        if unknown:
            raise ConfigError(
                f"{what}: {info.path} has prompts of data_source {unknown[:5]}, which no built-in "
                f"scorer scores (they score {sorted(BUILTIN_SCORERS)}); set reward.custom_fn to a "
                "scorer for them, or score with a reward model alone (reward.model_path=..., "
                "reward.rule_weight=0)"
            )


def check_inputs(
    cfg: RunConfig, layout: ParallelLayout, this_machine: bool = True
) -> ModelDims | None:
    """Every import path the config names, backends (``this_machine``: the run starts here),
    model folder, layout against it, reward model, data files (footers only) and the reward
    columns of the prompts; returns the reward model's shape (None: none)."""
    from megarl.backends import check_backends
    from megarl.data.parquet_source import inspect_files, resolve_files
    from megarl.models.dims import ModelDims

    check_import_settings(cfg)  # before anything slow: a typo costs seconds
    if this_machine:
        check_backends(cfg)  # vLLM / Transformer Engine where the config asks for them
    dims = ModelDims.from_pretrained(cfg.model.path)
    layout.check_model(dims.shape)
    _check_moe_options(cfg, dims)
    if cfg.model.critic_path:
        ModelDims.from_pretrained(cfg.model.critic_path)
    reward_model = None
    if cfg.reward.model_path:
        from megarl.rewards.model import check_reward_model

        reward_model = check_reward_model(cfg.reward.model_path, dims.vocab_size)
    for files, what in (
        (cfg.data.train_files, "data.train_files"),
        (cfg.data.val_files, "data.val_files"),
    ):
        if files:  # unreadable files fail here
            fs, paths = resolve_files(files, what=what)
            check_reward_columns(cfg, inspect_files(fs, paths), fs, what)
    return reward_model


def _check_moe_options(cfg: RunConfig, dims: ModelDims) -> None:
    """Router-loss settings need a mixture-of-experts model; LoRA needs a dense one."""

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
