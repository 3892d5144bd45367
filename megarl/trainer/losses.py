"""The actor and critic losses of one micro-batch, assembled from the registered algorithms."""

from __future__ import annotations

import torch

from megarl.algos import compute_policy_loss, compute_value_loss, entropy_bonus, kl_loss
from megarl.config import AlgorithmConfig, CriticConfig
from megarl.trainer.batch import Samples
from megarl.trainer.hparams import policy_loss_kwargs
from megarl.trainer.model_ops import response_log_probs, response_values


def make_actor_loss(cfg: AlgorithmConfig, vocab_size: int):
    """Policy loss (+ KL to the reference as a loss term, + entropy bonus) on vocab-parallel logits.

    Samples need ``old_log_prob`` and ``advantages`` (and ``ref_log_prob`` with use_kl_loss).
    """
    hparams = policy_loss_kwargs(cfg)
    want_entropy = cfg.entropy_coef != 0.0

    def loss_fn(logits_shard: torch.Tensor, mb: Samples):
        logp, entropy = response_log_probs(logits_shard, mb, vocab_size, with_entropy=True)
        t = mb.tensors
        loss, metrics = compute_policy_loss(
            cfg.policy_loss,
            old_log_prob=t["old_log_prob"],
            log_prob=logp,
            advantages=t["advantages"],
            response_mask=mb.response_mask,
            loss_agg_mode=cfg.loss_agg_mode,
            rollout_is_weights=t.get("tis_weights"),
            **hparams,
        )
        metrics = {f"actor/{k}": v for k, v in metrics.items()}
        metrics["actor/pg_loss"] = loss.detach()
        if cfg.use_kl_loss:
            kl, kl_metrics = kl_loss(
                logp,
                t["ref_log_prob"],
                mb.response_mask,
                kl_coef=cfg.kl_loss_coef,
                estimator=cfg.kl_loss_estimator,
                loss_agg_mode=cfg.loss_agg_mode,
            )
            loss = loss + kl
            metrics["actor/kl_loss"] = kl_metrics["kl_loss"]
        if entropy is not None:
            bonus, ent_metrics = entropy_bonus(
                entropy,
                mb.response_mask,
                entropy_coef=cfg.entropy_coef,
                loss_agg_mode=cfg.loss_agg_mode,
            )
            if want_entropy:
                loss = loss + bonus
            metrics["actor/entropy"] = ent_metrics["entropy"]
        return loss, metrics

    return loss_fn


def make_critic_loss(cfg: CriticConfig, loss_agg_mode: str):
    def loss_fn(output: torch.Tensor, mb: Samples):
        values = response_values(output, mb)
        loss, metrics = compute_value_loss(
            values,
            mb.tensors["values"],
            mb.tensors["returns"],
            mb.response_mask,
            cfg.cliprange_value,
            loss_agg_mode,
        )
        out = {f"critic/{k}": v for k, v in metrics.items()}
        out["critic/vf_loss"] = loss.detach()
        return loss, out

    return loss_fn
