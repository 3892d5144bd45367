"""The pure checks of the reward-model, SFT and DPO trainers' settings (trainer.kind), one per
kind in :data:`SUPERVISED_VALIDATORS`, called by :func:`megarl.config.validation.validate` with the
trainer's own section and the settings they share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megarl.config.batch_checks import check_dp_split, check_positive
from megarl.config.schema import (
    DataConfig,
    DPOConfig,
    ParallelConfig,
    RewardModelConfig,
    SFTConfig,
    TrainerConfig,
)
from megarl.errors import ConfigError


@dataclass(frozen=True)
class SupervisedShared:
    """The settings the reward-model, SFT and DPO trainers' checks share."""

    data: DataConfig
    trainer: TrainerConfig
    parallel: ParallelConfig
    world_size: int | None


def _validate_supervised(
    shared: SupervisedShared, section: str, micro_batch_size: int, max_length: int
) -> None:
    """What the reward-model, SFT and DPO trainers share: positive sizes, a usable max_length,
    batches that split over the data-parallel ranks."""
    data, world_size = shared.data, shared.world_size
    check_positive(
        {
            "data.train_batch_size": data.train_batch_size,
            f"{section}.micro_batch_size": micro_batch_size,
            "trainer.total_steps": shared.trainer.total_steps,
        }
    )
    if max_length < 2:
        raise ConfigError(f"{section}.max_length must be >= 2 tokens, got {max_length}")
    if world_size is not None:
        batches = {"data.train_batch_size": data.train_batch_size}
        if data.val_files:
            batches["data.val_batch_size"] = data.val_batch_size
        check_dp_split(shared.parallel, world_size, batches)


def _validate_reward_model(rm: RewardModelConfig, shared: SupervisedShared) -> None:
    _validate_supervised(shared, "reward_model", rm.micro_batch_size, rm.max_length)


def _validate_sft(sft: SFTConfig, shared: SupervisedShared) -> None:
    _validate_supervised(shared, "sft", sft.micro_batch_size, sft.max_length)
    budget = sft.max_tokens_per_micro_batch
    if budget is not None and budget < 2:
        raise ConfigError(
            f"sft.max_tokens_per_micro_batch={budget} must be >= 2 tokens (or null: "
            "sft.micro_batch_size sequences per micro-batch)"
        )


def _validate_dpo(dpo: DPOConfig, shared: SupervisedShared) -> None:
    _validate_supervised(shared, "dpo", dpo.micro_batch_size, dpo.max_length)


# trainer.kind -> the check of that trainer's section (the section of the kind's own name)
SUPERVISED_VALIDATORS: dict[str, Callable[..., None]] = {
    "reward_model": _validate_reward_model,
    "sft": _validate_sft,
    "dpo": _validate_dpo,
}
