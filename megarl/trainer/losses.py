"""The actor and critic losses of one micro-batch, assembled from the registered algorithms."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megarl.algos import compute_policy_loss, compute_value_loss, entropy_bonus, kl_loss
from megarl.algos.choices import AlgorithmKwargs
from megarl.config import AlgorithmConfig
from megarl.trainer.batch import Samples
from megarl.trainer.distill import distill_loss_term
from megarl.trainer.model_ops import response_log_probs, response_values

Metrics = dict[str, torch.Tensor]


def sampling_temperature(rollout_temperature: float) -> float:
    """The temperature every trainer logprob is computed with for a rollout sampled at
    ``rollout.sampling.temperature`` (logits / temperature, as vLLM's processed logprobs); greedy (0)
    samples the untempered distribution's argmax and is scored at 1."""
    return rollout_temperature if rollout_temperature > 0 else 1.0


def loss_agg_options(kwargs: AlgorithmKwargs) -> Callable[[int], dict[str, Any]]:
    """Options of the loss aggregation for a micro-batch of ``rows`` sequences: ``fn(rows)``.

    Sequence-level modes divide by the micro-batch's row count (padding rows included): the
    trainer weighs each micro-batch by its share of the mini-batch's rows, so the sum over
    micro-batches is the mini-batch's loss whatever the micro-batching.
    """
    static = dict(kwargs.loss_agg)

    def options(rows: int) -> dict[str, Any]:
        return {**static, "num_seqs": rows} if kwargs.loss_agg_per_rows else dict(static)

    return options


def make_actor_policy_terms(
    a: AlgorithmConfig, kwargs: AlgorithmKwargs, from_update: bool
) -> Callable[[torch.Tensor, torch.Tensor | None, Samples], tuple[torch.Tensor, Metrics]]:
    """Policy loss (+ KL to the reference as a loss term, + entropy bonus) of one micro-batch from
    its response logprobs (and entropy): the actor loss once the logits are reduced.

    With ``from_update`` the update's own logprobs are the old ones
    (:func:`megarl.trainer.old_log_probs.old_log_prob_from_update`): they serve as
    ``old_log_prob`` (detached) and come back among the metrics under that name.
    """
    hparams = dict(kwargs.policy_loss)
    agg_options = loss_agg_options(kwargs)
    want_entropy = a.entropy_coef != 0.0

    def terms(logp: torch.Tensor, entropy: torch.Tensor | None, mb: Samples):
        t = mb.tensors
        agg = agg_options(mb.size)
        old = logp.detach() if from_update else t.require("old_log_prob")
        loss, metrics = compute_policy_loss(
            a.policy_loss,
            old_log_prob=old,
            log_prob=logp,
            advantages=t.require("advantages"),
            response_mask=mb.response_mask,
            loss_agg_mode=a.loss_agg_mode,
            loss_agg_kwargs=agg,
            rollout_is_weights=t.rollout_is_weights,  # None without algorithm.rollout_correction
            **hparams,
        )
        metrics = {f"actor/{k}": v for k, v in metrics.items()}
        metrics["actor/pg_loss"] = loss.detach()
        if a.use_kl_loss:
            kl, kl_metrics = kl_loss(
                logp,
                t.require("ref_log_prob"),
                mb.response_mask,
                kl_coef=a.kl_loss_coef,
                estimator=a.kl_loss_estimator,
                loss_agg_mode=a.loss_agg_mode,
                loss_agg_kwargs=agg,
            )
            loss = loss + kl
            metrics["actor/kl_loss"] = kl_metrics["kl_loss"]
        distill, distill_metrics = distill_loss_term(
            a.distill, logp, mb, a.loss_agg_mode, agg
        )  # algorithm.distill.mode=loss
        if distill is not None:
            loss = loss + distill
            metrics.update(distill_metrics)
        if entropy is not None:
            bonus, ent_metrics = entropy_bonus(
                entropy,
                mb.response_mask,
                entropy_coef=a.entropy_coef,
                loss_agg_mode=a.loss_agg_mode,
                loss_agg_kwargs=agg,
            )
            if want_entropy:
                loss = loss + bonus
            metrics["actor/entropy"] = ent_metrics["entropy"]
        if from_update:  # under the name of the field ppo_update keeps them in
            metrics["old_log_prob"] = old
        return loss, metrics

    return terms


def make_actor_loss(
    a: AlgorithmConfig,
    kwargs: AlgorithmKwargs,
    vocab_size: int,
    temperature: float,
    from_update: bool,
):
    """The actor loss on vocab-parallel logits divided by ``temperature``
    (:func:`sampling_temperature`).

    Samples need ``advantages``, ``old_log_prob`` unless ``from_update`` (the update's own
    logprobs are the old ones), and ``ref_log_prob`` with use_kl_loss.
    """
    terms = make_actor_policy_terms(a, kwargs, from_update)

    def loss_fn(logits_shard: torch.Tensor, mb: Samples):
        logp, entropy = response_log_probs(
            logits_shard, mb, vocab_size, with_entropy=True, temperature=temperature
        )
        return terms(logp, entropy, mb)

    return loss_fn


def make_critic_loss(a: AlgorithmConfig, kwargs: AlgorithmKwargs, cliprange_value: float):
    """The critic's value loss (``critic.cliprange_value``) in ``a.loss_agg_mode``."""
    agg_options = loss_agg_options(kwargs)

    def loss_fn(output: torch.Tensor, mb: Samples):
        values = response_values(output, mb)
        loss, metrics = compute_value_loss(
            values,
            mb.tensors.require("values"),
            mb.tensors.require("returns"),
            mb.response_mask,
            cliprange_value,
            a.loss_agg_mode,
            agg_options(mb.size),
        )
        out = {f"critic/{k}": v for k, v in metrics.items()}
        out["critic/vf_loss"] = loss.detach()
        return loss, out

    return loss_fn
