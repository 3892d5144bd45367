"""The models a PPO/GRPO run needs, built for this rank: actor (trained), reference (only when a
KL term needs it), critic (only for estimators that take values)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megarl.config import (
    ActorConfig,
    CriticConfig,
    DistillConfig,
    ModelConfig,
    ParallelConfig,
    TrainerConfig,
)
from megarl.models.build import build_model
from megarl.models.dims import ModelDims
from megarl.models.lora import adapters_disabled
from megarl.parallel import ParallelLayout
from megarl.run.trainable import (
    Trainable,
    build_trainable,
    lora_settings,
    model_options,
    optim_settings,
)
from megarl.trainer.distill import Teacher, build_teacher
from megarl.trainer.spec import AlgorithmSpec

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


def updates_per_step(train_batch_size: int, mini_batch_size: int, epochs: int) -> int:
    """Optimizer steps per training step: ``epochs`` passes over the batch in mini-batches."""
    return epochs * (train_batch_size // mini_batch_size)


@dataclass(frozen=True)
class Roles:
    actor: Trainable
    dims: ModelDims
    reference: GPTModel | None
    critic: Trainable | None
    # LoRA: the reference policy is the actor's frozen base (its adapters disabled), no model
    reference_is_actor_base: bool = False
    teacher: Teacher | None = None  # on-policy distillation's frozen teacher (algorithm.distill)

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self.reference_is_actor_base

    @contextmanager
    def reference_model(self) -> Iterator[GPTModel]:
        """The model whose logprobs are the reference's: the frozen reference model, or a LoRA
        actor with its adapters disabled for the block."""
        if self.reference_is_actor_base:
            with adapters_disabled(self.actor.model) as base:
                yield base
        else:
            assert self.reference is not None, "this run has no reference model"
            yield self.reference

    def trainables(self) -> dict[str, Trainable]:
        """The models the run trains (and checkpoints with their optimizers), by role."""
        return {n: t for n, t in (("actor", self.actor), ("critic", self.critic)) if t is not None}


@dataclass(frozen=True)
class RoleSections:
    """The config sections the roles are built from (``batch``: data.train_batch_size)."""

    model: ModelConfig
    parallel: ParallelConfig
    actor: ActorConfig
    critic: CriticConfig
    distill: DistillConfig
    trainer: TrainerConfig
    batch: int


def build_roles(sections: RoleSections, layout: ParallelLayout, spec: AlgorithmSpec) -> Roles:
    model, actor_cfg, critic_cfg = sections.model, sections.actor, sections.critic
    opts = model_options(model, sections.parallel, actor_cfg.lora)
    total = sections.trainer.total_steps
    batch, mini_batch = sections.batch, actor_cfg.ppo_mini_batch_size
    lora = lora_settings(actor_cfg.lora, sections.trainer.seed)
    actor, dims = build_trainable(
        model.path,
        layout,
        "actor",
        opts,
        optim_settings(
            actor_cfg.optim,
            total * updates_per_step(batch, mini_batch, actor_cfg.ppo_epochs),
            actor_cfg.optimizer_offload,
        ),
        lora=lora,
    )
    reference = None
    base_is_reference = spec.needs_reference and lora is not None
    if spec.needs_reference and not base_is_reference:
        reference, _ = build_model(model.path, layout, "reference", opts)
    critic = None
    if spec.needs_critic:
        critic, _ = build_trainable(
            model.critic_path or model.path,
            layout,
            "critic",
            opts,
            optim_settings(
                critic_cfg.optim, total * updates_per_step(batch, mini_batch, critic_cfg.ppo_epochs)
            ),
        )
    return Roles(
        actor=actor,
        dims=dims,
        reference=reference,
        critic=critic,
        reference_is_actor_base=base_is_reference,
        teacher=build_teacher(sections.distill, layout, opts),
    )
