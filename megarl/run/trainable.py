"""A trained model with its megatron DDP wrapper, optimizer and scheduler, and how one is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from megarl.config import (
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainerConfig,
    model_dtype,
)
from megarl.dtypes import dtype_from_name
from megarl.models.build import ModelOptions, build_model
from megarl.models.dims import ModelDims
from megarl.models.distributed import OptimSettings, wrap_for_training
from megarl.models.lora import LoraSettings, add_lora_for_layout
from megarl.parallel import ParallelLayout

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


@dataclass(frozen=True)
class Trainable:
    model: GPTModel
    ddp: DistributedDataParallel
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler


class TrainedModels(Protocol):
    """What a checkpoint saves and restores: the trained models by role, and their dims."""

    @property
    def dims(self) -> ModelDims: ...

    def trainables(self) -> dict[str, Trainable]: ...


def optim_settings(
    o: OptimConfig, total_updates: int, optimizer_offload: float = 0.0
) -> OptimSettings:
    return OptimSettings(
        optimizer_offload=optimizer_offload,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        warmup_steps=o.warmup_steps,
        total_steps=total_updates,
        lr_decay_style=o.lr_decay_style,
    )


def lora_settings(lora: LoraConfig, seed: int) -> LoraSettings | None:
    """The actor's LoRA adapters (actor.lora, drawn from the run's ``seed``; None: LoRA off,
    every weight trains)."""
    if lora.rank == 0:
        return None
    return LoraSettings(
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=tuple(lora.target_modules),
        seed=seed,
    )


def model_options(model: ModelConfig, parallel: ParallelConfig, lora: LoraConfig) -> ModelOptions:
    """How the run's models are built (``lora``: the actor's adapters, which need megatron's own
    linears)."""
    impl = model.transformer_impl
    if lora.rank and impl == "auto":
        impl = "local"  # LoRA adapts megatron's own parallel linears (not Transformer Engine's)
    return ModelOptions(
        dtype=dtype_from_name(model_dtype(model, torch.cuda.is_available())),
        recompute=model.recompute,
        recompute_num_layers=model.recompute_num_layers,
        transformer_impl=impl,
        sequence_parallel=parallel.sequence_parallel,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff,
    )


def build_trainable(
    path: str | Path,
    layout: ParallelLayout,
    role: str,
    opts: ModelOptions,
    settings: OptimSettings,
    lora: LoraSettings | None = None,
) -> tuple[Trainable, ModelDims]:
    """This rank's shard of a model loaded from ``path``, wrapped for training; with ``lora``
    the loaded weights are frozen and only LoRA adapters train (and enter the optimizer)."""
    model, dims = build_model(path, layout, role, opts)
    if lora is not None:
        add_lora_for_layout(model, dims, layout, lora)
    ddp, optimizer, scheduler = wrap_for_training(model, settings)
    return Trainable(model, ddp, optimizer, scheduler), dims


@dataclass(frozen=True)
class PolicyModel:
    """The one model the SFT and DPO trainers train and checkpoint: a causal LM under the
    ``actor`` role, so that it exports (``megarl convert mcore-to-hf``) as policies do."""

    actor: Trainable
    dims: ModelDims

    def trainables(self) -> dict[str, Trainable]:
        return {"actor": self.actor}


def build_policy(
    model: ModelConfig,
    parallel: ParallelConfig,
    lora: LoraConfig,
    trainer: TrainerConfig,
    layout: ParallelLayout,
    optim: OptimConfig,
) -> PolicyModel:
    """``model.path`` at ``layout``, trained with ``optim`` for ``trainer.total_steps`` steps
    (LoRA adapters only with ``actor.lora``)."""
    actor, dims = build_trainable(
        model.path,
        layout,
        "actor",
        model_options(model, parallel, lora),
        optim_settings(optim, trainer.total_steps),
        lora=lora_settings(lora, trainer.seed),
    )
    return PolicyModel(actor, dims)
