"""The algorithm choices of a PPO/GRPO run, resolved once from the config into a typed spec.

Everything that depends on the algorithm's config words (which models exist, the loss functions,
how their metrics combine over ranks, the KL controller) is decided here by looking up the
registered functions, never by branching on a name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from megarl.algos import POLICY_LOSS_REDUCTIONS, make_kl_controller
from megarl.algos.choices import resolve_algorithm_kwargs
from megarl.algos.kl import KLController
from megarl.config import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    SamplingSettings,
)
from megarl.metrics import Reduce
from megarl.models.forward import LossOver
from megarl.trainer.batch import Samples
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
    kl_ctrl: str  # the KL coefficient's controller of a KL penalty in the reward
    kl_ctrl_kwargs: Mapping[str, float]  # the settings it takes
    kl_ctrl_n_steps: int  # data.train_batch_size: the prompts an adaptive KL update counts
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


def resolve_algorithm(
    a: AlgorithmConfig,
    sampling: SamplingSettings,
    actor: ActorConfig,
    critic: CriticConfig,
    data: DataConfig,
    vocab_size: int,
) -> AlgorithmSpec:
    """The run's algorithm: its config words resolved once through the registries (ConfigError
    naming the fix for a bad one, before any model is built) and the losses built from them."""
    kwargs = resolve_algorithm_kwargs(a, sampling, try_them=True)
    temperature = sampling_temperature(sampling.temperature)
    from_update = old_log_prob_from_update(a, actor, data.train_batch_size)
    return AlgorithmSpec(
        needs_reference=a.use_kl_loss or a.use_kl_in_reward,
        needs_critic="values" in kwargs.adv_inputs,
        adv_estimator=a.adv_estimator,
        advantage_inputs=kwargs.adv_inputs,
        advantage_kwargs=dict(kwargs.adv_estimator),
        actor_loss=make_actor_loss(a, kwargs, vocab_size, temperature, from_update),
        critic_loss=make_critic_loss(a, kwargs, critic.cliprange_value),
        token_level=a.loss_agg_mode == "token-mean",
        kl_in_reward=a.use_kl_in_reward,
        kl_in_reward_estimator=a.kl_in_reward_estimator,
        kl_ctrl=a.kl_ctrl,
        kl_ctrl_kwargs=dict(kwargs.kl_controller),
        kl_ctrl_n_steps=data.train_batch_size,
        rollout_correction=a.rollout_correction,
        rollout_correction_kwargs=dict(kwargs.rollout_correction),
        temperature=temperature,
        old_log_prob_from_update=from_update,
        update_reductions={f"actor/{k}": r for k, r in POLICY_LOSS_REDUCTIONS.items()},
    )


def make_kl_in_reward_controller(spec: AlgorithmSpec) -> KLController | None:
    """The KL coefficient's controller of a run with a KL penalty in the reward (None without)."""
    if not spec.kl_in_reward:
        return None
    return make_kl_controller(spec.kl_ctrl, **spec.kl_ctrl_kwargs)
