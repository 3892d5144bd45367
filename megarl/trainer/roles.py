"""The models a run needs, built for this rank: actor (trained), reference (only when a KL term
needs it), critic (only for estimators that take values)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.config import OptimConfig, RunConfig
from megarl.models.build import ModelOptions, build_model
from megarl.models.distributed import OptimSettings, wrap_for_training
from megarl.parallel import ParallelLayout
from megarl.trainer.hparams import advantage_inputs


@dataclass
class Trainable:
    model: object  # the GPTModel
    ddp: object
    optimizer: object
    scheduler: object


def optim_settings(o: OptimConfig, total_updates: int) -> OptimSettings:
    return OptimSettings(
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        warmup_steps=o.warmup_steps,
        total_steps=total_updates,
        lr_decay_style=o.lr_decay_style,
    )


def needs_reference(cfg: RunConfig) -> bool:
    return cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward


def needs_critic(cfg: RunConfig) -> bool:
    return "values" in advantage_inputs(cfg)


def updates_per_step(cfg: RunConfig, epochs: int) -> int:
    return epochs * (cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size)


@dataclass
class Roles:
    actor: Trainable
    dims: object
    reference: object | None
    critic: Trainable | None

    def trainables(self) -> dict[str, Trainable]:
        """The models the run trains (and checkpoints with their optimizers), by role."""
        return {n: t for n, t in (("actor", self.actor), ("critic", self.critic)) if t is not None}


def model_options(cfg: RunConfig) -> ModelOptions:
    return ModelOptions(
        dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype],
        recompute=cfg.model.recompute,
    )


def build_roles(cfg: RunConfig, layout: ParallelLayout) -> Roles:
    opts = model_options(cfg)
    total = cfg.trainer.total_steps
    actor_model, dims = build_model(cfg.model.path, layout, "actor", opts)
    ddp, opt, sched = wrap_for_training(
        actor_model,
        optim_settings(cfg.actor.optim, total * updates_per_step(cfg, cfg.actor.ppo_epochs)),
    )
    actor = Trainable(actor_model, ddp, opt, sched)
    reference = (
        build_model(cfg.model.path, layout, "reference", opts)[0] if needs_reference(cfg) else None
    )
    critic = None
    if needs_critic(cfg):
        critic_model, _ = build_model(
            cfg.model.critic_path or cfg.model.path, layout, "critic", opts
        )
        c_ddp, c_opt, c_sched = wrap_for_training(
            critic_model,
            optim_settings(cfg.critic.optim, total * updates_per_step(cfg, cfg.critic.ppo_epochs)),
        )
        critic = Trainable(critic_model, c_ddp, c_opt, c_sched)
    return Roles(actor=actor, dims=dims, reference=reference, critic=critic)
