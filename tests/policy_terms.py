"""The actor's policy terms of a config, built as the trainer's assembly builds them."""

from __future__ import annotations

from megarl.algos.choices import resolve_algorithm_kwargs
from megarl.config import RunConfig
from megarl.trainer.losses import make_actor_policy_terms
from megarl.trainer.old_log_probs import old_log_prob_from_update
from megarl.trainer.spec import AlgorithmSpec, resolve_algorithm


def from_update(cfg: RunConfig) -> bool:
    """Whether ``cfg``'s update takes its own logprobs as the old ones."""
    return old_log_prob_from_update(cfg.algorithm, cfg.actor, cfg.data.train_batch_size)


def policy_terms(cfg: RunConfig):
    """``make_actor_policy_terms`` of ``cfg``'s algorithm section."""
    kwargs = resolve_algorithm_kwargs(cfg.algorithm, cfg.rollout.sampling)
    return make_actor_policy_terms(cfg.algorithm, kwargs, from_update(cfg))


def algorithm_spec(cfg: RunConfig, vocab_size: int) -> AlgorithmSpec:
    """``cfg``'s algorithm spec, resolved from its sections as the trainer's assembly does."""
    return resolve_algorithm(
        cfg.algorithm, cfg.rollout.sampling, cfg.actor, cfg.critic, cfg.data, vocab_size
    )
