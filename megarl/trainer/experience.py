"""From a rollout to training tensors: rewards, reference logprobs, values, KL, advantages."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megarl.algos import (
    apply_kl_in_reward,
    compute_advantages,
    compute_tis_weights,
    explained_variance,
    masked_mean,
)
from megarl.config import RunConfig
from megarl.rewards.manager import RewardManager, RewardSample
from megarl.rewards.overlong import overlong_penalty
from megarl.trainer.batch import Samples
from megarl.trainer.hparams import advantage_inputs, advantage_kwargs
from megarl.trainer.losses import sampling_temperature
from megarl.trainer.model_ops import (
    MicroBatching,
    forward_response_tensor,
    response_log_probs,
    response_values,
)


def decode_responses(batch, tokenizer) -> list[str]:
    return tokenizer.batch_decode(batch.output.token_ids, skip_special_tokens=True)


def rule_scores(rewards: RewardManager, items, batch, texts: list[str]):
    """One rule score per sample (the reward manager's scorers) and their metrics."""
    samples = [
        RewardSample(
            data_source=items[i].data_source,
            solution_str=text,
            ground_truth=items[i].ground_truth,
            extra_info=items[i].extra_info,
        )
        for i, text in zip(batch.output.prompt_index, texts, strict=True)
    ]
    result = rewards.score(samples)
    return torch.tensor(result.scores, dtype=torch.float32), dict(result.metrics)


def score_rollout(
    run, items, batch, batching: MicroBatching, shaping: bool = True
) -> tuple[Samples, torch.Tensor, dict[str, float], list[str]]:
    """Samples of a rollout with their outcome scores: rule scorers, a reward model, or both
    (``reward.rule_weight * rule + reward.model_weight * model``), plus the overlong penalty
    (``reward.overlong_buffer``) with ``shaping``; also the decoded responses."""
    from megarl.reward_model.policy_reward import combine_scores
    from megarl.reward_model.scoring import score_sequences

    r = run.cfg.reward
    texts = decode_responses(batch, run.tokenizer)
    samples = build_samples(items, batch, run.pad_id)
    metrics: dict[str, float] = {}
    rule = torch.zeros(samples.size)
    if r.rule_weight != 0:
        rule, metrics = rule_scores(run.rewards, items, batch, texts)
        metrics["reward/rule_mean"] = float(rule.mean())
    model = None
    if run.reward_model is not None:
        model = score_sequences(
            run.reward_model, samples.input_ids, samples.seq_lens(), batching.size, run.pad_id
        )
        metrics["reward/model_mean"] = float(model.mean())
        metrics["reward/model_std"] = float(model.std()) if model.numel() > 1 else 0.0
    scores = combine_scores(rule, model, r.rule_weight, r.model_weight)
    if shaping and r.overlong_buffer.len > 0:
        penalty = overlong_penalty(
            samples.response_lens,
            max_length=run.cfg.rollout.max_response_length,
            buffer_length=r.overlong_buffer.len,
            penalty_factor=r.overlong_buffer.penalty_factor,
        )
        scores = scores + penalty
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
    set_outcome_scores(samples, scores)
    return samples, scores, metrics, texts


def set_outcome_scores(samples: Samples, scores: torch.Tensor) -> None:
    """The outcome reward of each sample, on its last response token."""
    token_scores = torch.zeros_like(samples.response_mask)
    last = (samples.response_lens - 1).clamp(min=0)
    token_scores[torch.arange(samples.size), last] = scores * (samples.response_lens > 0)
    samples.tensors["token_level_scores"] = token_scores


def build_samples(items, batch, pad_id: int) -> Samples:
    responses = batch.output.token_ids
    prompts = [batch.prompts[i] for i in batch.output.prompt_index]
    groups = [items[i].uid for i in batch.output.prompt_index]
    samples = Samples.from_sequences(prompts, responses, groups, pad_id)
    if batch.actor_logprobs is not None:  # validation rollouts are not scored by the actor
        old = batch.response_actor_logprobs()
        samples.tensors["old_log_prob"] = _pad_rows(old, samples.response_mask.shape[1])
    samples.tensors["rollout_log_prob"] = _pad_rows(
        [torch.tensor(lp, dtype=torch.float32) for lp in batch.output.logprobs],
        samples.response_mask.shape[1],
    )
    return samples


def _pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r.float().cpu()
    return out


def _dp_mean(value: float) -> float:
    from megatron.core import parallel_state as ps

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t.item() / dist.get_world_size(ps.get_data_parallel_group()))


def compute_experience(
    cfg: RunConfig, roles, samples: Samples, kl_ctrl, batching: MicroBatching
) -> dict[str, Any]:
    """Fill ``samples.tensors`` with ref_log_prob, values, token_level_rewards, advantages, returns."""
    metrics: dict[str, float] = {}
    t, mask = samples.tensors, samples.response_mask
    vocab = roles.dims.vocab_size
    temperature = sampling_temperature(cfg)
    if roles.reference is not None:
        t["ref_log_prob"] = forward_response_tensor(
            roles.reference,
            samples,
            lambda out, mb: response_log_probs(out, mb, vocab, temperature=temperature)[0],
            batching,
        )
    if roles.critic is not None:
        t["values"] = forward_response_tensor(
            roles.critic.model, samples, response_values, batching
        )
    rewards = t["token_level_scores"]
    if cfg.algorithm.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_in_reward(
            rewards,
            t["old_log_prob"],
            t["ref_log_prob"],
            mask,
            kl_coef=kl_ctrl.value,
            estimator=cfg.algorithm.kl_in_reward_estimator,
        )
        kl = _dp_mean(float(kl_metrics["kl"]))
        kl_ctrl.update(kl, n_steps=cfg.data.train_batch_size)
        metrics.update({"actor/reward_kl": kl, "actor/kl_coef": float(kl_ctrl.value)})
    t["token_level_rewards"] = rewards
    inputs = advantage_inputs(cfg)
    extra = {}
    if "values" in inputs:
        extra["values"] = t["values"]
    if "group_ids" in inputs:
        extra["group_ids"] = samples.group_ids
    t["advantages"], t["returns"] = compute_advantages(
        cfg.algorithm.adv_estimator,
        token_level_rewards=rewards,
        response_mask=mask,
        **extra,
        **advantage_kwargs(cfg),
    )
    if cfg.algorithm.tis_cap is not None:
        t["tis_weights"], tis_metrics = compute_tis_weights(
            t["old_log_prob"], t["rollout_log_prob"], mask, cap=cfg.algorithm.tis_cap
        )
        metrics.update({f"rollout/{k}": float(v) for k, v in tis_metrics.items()})
    if "values" in t:
        metrics["critic/values_mean"] = float(masked_mean(t["values"], mask))
        # how much of the returns' variance the critic (before this step's update) explains
        metrics["critic/explained_var"] = float(explained_variance(t["values"], t["returns"], mask))
    metrics["actor/advantages_mean"] = float(masked_mean(t["advantages"], mask))
    return metrics
