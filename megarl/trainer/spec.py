"""The algorithm choices of a PPO/GRPO run, resolved once from the config into a typed spec.

Everything that depends on the algorithm's config words (which models exist, the loss functions,
how their metrics combine over ranks, the KL controller) is decided here by looking up the
registered functions, never by branching on a name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from megarl.algos import POLICY_LOSS_REDUCTIONS, make_kl_controller
from megarl.algos.kl import KLController
from megarl.config import RunConfig
from megarl.metrics import Reduce
from megarl.models.forward import LossOver
from megarl.trainer.batch import Samples
from megarl.trainer.hparams import (
    advantage_inputs,
    advantage_kwargs,
    kl_controller_kwargs,
    rollout_correction_kwargs,
)
from megarl.trainer.losses import make_actor_loss, make_critic_loss, sampling_temperature
from megarl.trainer.old_log_probs import old_log_prob_from_update


@dataclass(frozen=True)
class AlgorithmSpec:
    needs_reference: bool  # a KL term (loss or reward) compares against the reference model
    needs_critic: bool  # the advantage estimator takes values
    adv_estimator: str
    advantage_inputs: frozenset[str]  # which of values / group_ids the estimator takes
    advantage_kwargs: Mapping[str, float | bool]  # the hyperparameters it takes
    actor_loss: LossOver[Samples]
    critic_loss: LossOver[Samples]
    token_level: bool  # token-mean loss aggregation: micro-batches weigh by tokens, not rows
    kl_in_reward: bool
    kl_in_reward_estimator: str
    # the off-policy correction of the rollout (algorithm.rollout_correction) and its settings
    rollout_correction: str
    rollout_correction_kwargs: Mapping[str, object]
    # every actor/reference logprob is of softmax(logits / temperature), the distribution the
    # rollout sampled from (1 for greedy rollouts)
    temperature: float
    # the update's own (detached) logprobs are the old ones: no separate scoring forward
    old_log_prob_from_update: bool
    # how the actor's and critic's update metrics combine over ranks (the rest: mean)
    update_reductions: Mapping[str, Reduce]


def resolve_algorithm(cfg: RunConfig, vocab_size: int) -> AlgorithmSpec:
    a = cfg.algorithm
    inputs = advantage_inputs(cfg)
    return AlgorithmSpec(
        needs_reference=a.use_kl_loss or a.use_kl_in_reward,
        needs_critic="values" in inputs,
        adv_estimator=a.adv_estimator,
        advantage_inputs=inputs,
        advantage_kwargs=advantage_kwargs(cfg),
        actor_loss=make_actor_loss(cfg, vocab_size),
        critic_loss=make_critic_loss(cfg),
        token_level=a.loss_agg_mode == "token-mean",
        kl_in_reward=a.use_kl_in_reward,
        kl_in_reward_estimator=a.kl_in_reward_estimator,
        rollout_correction=a.rollout_correction,
        rollout_correction_kwargs=rollout_correction_kwargs(cfg),
        temperature=sampling_temperature(cfg),
        old_log_prob_from_update=old_log_prob_from_update(cfg),
        update_reductions={f"actor/{k}": r for k, r in POLICY_LOSS_REDUCTIONS.items()},
    )


def make_kl_in_reward_controller(cfg: RunConfig) -> KLController | None:
    """The KL coefficient's controller of a run with a KL penalty in the reward (None without)."""
    a = cfg.algorithm
    if not a.use_kl_in_reward:
        return None
    return make_kl_controller(a.kl_ctrl, **kl_controller_kwargs(cfg))
