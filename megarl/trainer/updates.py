"""The step's update phase: the actor's (and the critic's) PPO updates over the mini-batches."""

from __future__ import annotations

from megarl.metrics import StepMetrics, declare
from megarl.rollout.mismatch import LOGPROB_MISMATCH_REDUCTIONS
from megarl.run.steps import timed
from megarl.trainer.assembly import PolicyRun
from megarl.trainer.batch import Samples
from megarl.trainer.model_ops import ppo_update
from megarl.trainer.old_log_probs import rollout_mismatch
from megarl.trainer.routing_flags import flags_buffer


def update_models(
    run: PolicyRun, samples: Samples, actor_epochs: int, critic_epochs: int
) -> StepMetrics:
    """Actor (and critic) PPO updates over the mini-batches, ``actor.ppo_epochs`` and
    ``critic.ppo_epochs`` times; their last step's metrics and their timings. When the actor's
    update gives the old logprobs, also the rollout mismatch measured on them."""
    roles = run.roles
    from_update = run.spec.old_log_prob_from_update
    parts = [("actor", roles.actor, run.spec.actor_loss, actor_epochs)]
    if roles.critic is not None:
        parts.append(("critic", roles.critic, run.spec.critic_loss, critic_epochs))
    out: StepMetrics = {}
    flags = flags_buffer(samples) if from_update else None  # MoE: the mismatch split by routing
    for role, trainable, loss, epochs in parts:
        with timed(f"update_{role}") as took:
            hist = ppo_update(
                trainable,
                role,
                samples,
                run.mini_batches(samples.size),
                epochs,
                run.batching,
                loss,
                run.spec.token_level,
                run.trainer.nan_policy == "skip",
                keep="old_log_prob" if from_update and role == "actor" else None,
                extremes=run.spec.update_reductions,
                routing_flags=flags if role == "actor" else None,
            )
        out.update(took.metrics())
        out.update(declare(hist[-1], run.spec.update_reductions))
    if from_update:
        mismatch = rollout_mismatch(samples, roles.dims.is_moe, flags)
        out.update(declare(mismatch, LOGPROB_MISMATCH_REDUCTIONS))
    return out


__all__ = ["update_models"]
