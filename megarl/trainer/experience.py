"""From a rollout to training tensors: rewards, reference logprobs, values, KL, advantages."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from megarl import parallel, platform
from megarl.algos import (
    ROLLOUT_CORRECTION_REDUCTIONS,
    apply_kl_in_reward,
    compute_advantages,
    compute_rollout_correction,
    explained_variance_from_sums,
    explained_variance_sums,
)
from megarl.algos.kl import KLController
from megarl.algos.masked import masked_count, masked_sum
from megarl.config import OverlongBufferConfig, RewardConfig
from megarl.data import PromptItem
from megarl.envs.trajectory import Trajectory
from megarl.metrics import StepMetrics, declare, mean
from megarl.rewards.failures import BatchScorer, Failures, describe_failure, describe_first
from megarl.rewards.judge import Answerer, JudgeScorer
from megarl.rewards.judge_prompt import JudgeTemplate
from megarl.rewards.manager import RewardError, RewardManager, RewardSample
from megarl.rewards.model import combine_scores, score_sequences
from megarl.rewards.overlong import overlong_penalty
from megarl.rewards.remote_settings import RemoteSettings
from megarl.rewards.shares import ROLLOUT_SAMPLES
from megarl.rollout.judge_engine import EngineJudge
from megarl.rollout.rollout_batch import RolloutBatch
from megarl.trainer.batch import Samples, padded_routes
from megarl.trainer.distill import distill_experience
from megarl.trainer.dp_collectives import dp_mean, dp_sum
from megarl.trainer.model_ops import (
    MicroBatching,
    forward_response_tensor,
    policy_log_probs,
    response_values,
)
from megarl.trainer.reward_failures import non_finite_model_scores, stop_on_failed_scores
from megarl.trainer.roles import Roles
from megarl.trainer.spec import AlgorithmSpec

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from transformers import PreTrainedTokenizerBase

    from megarl.rewards.remote import RemoteScorer


Scored = TypeVar("Scored")


@dataclass(frozen=True)
class RewardSources:
    """The outcome reward of a rollout: ``rule_weight * rules + model_weight * model +
    remote_weight * remote + judge_weight * judge``."""

    rules: RewardManager  # rule scorers by data_source (or a custom function)
    model: GPTModel | None  # a frozen reward model (reward.model_path), colocated
    rule_weight: float
    model_weight: float
    overlong: OverlongBufferConfig  # DAPO's overlong shaping (len 0: off)
    max_response_length: int
    max_failed_fraction: float = 0.5  # reward.max_failed_fraction
    model_path: str | None = None
    remote: RemoteScorer | None = None  # a remote reward service (reward.remote_url)
    remote_weight: float = 1.0
    judge: JudgeScorer | None = None  # a generative judge (reward.judge)
    judge_weight: float = 1.0

    @classmethod
    def from_config(
        cls, r: RewardConfig, model: GPTModel | None, max_response_length: int, judge_dtype: str
    ) -> RewardSources:
        """The ``reward`` section's sources; ``judge_dtype``: the dtype name a local judge runs
        in (the rollout's)."""
        rules = RewardManager(
            custom_fn=r.custom_fn, num_workers=r.num_workers, timeout_s=r.timeout_s, strict=r.strict
        )
        return cls(
            rules,
            model,
            r.rule_weight,
            r.model_weight,
            r.overlong_buffer,
            max_response_length,
            r.max_failed_fraction,
            r.model_path,
            remote_scorer(r),
            r.remote_weight,
            judge_scorer(r, judge_dtype),
            r.judge.weight,
        )

    def close(self) -> None:
        self.rules.close()


def remote_scorer(r: RewardConfig) -> RemoteScorer | None:
    """The client of ``reward.remote_url`` (None without one)."""
    settings = RemoteSettings.from_config(r)
    if settings is None:
        return None
    from megarl.rewards.remote import RemoteScorer  # aiohttp: only for a remote reward

    return RemoteScorer(settings, strict=r.strict)


def judge_scorer(r: RewardConfig, dtype: str) -> JudgeScorer | None:
    """The judge of ``reward.judge`` (None without one): a local engine in ``dtype`` for a
    ``model_path``, else the OpenAI-compatible server at ``url``."""
    j = r.judge
    if j.model_path is None and j.url is None:
        return None
    answerer: Answerer
    if j.model_path is not None:
        answerer = EngineJudge(j.model_path, j, dtype)
    else:
        from megarl.rewards.judge_remote import OpenAIJudge  # the openai client

        answerer = OpenAIJudge(j)
    return JudgeScorer(JudgeTemplate.from_config(j), answerer, strict=r.strict)


def decode_responses(batch: RolloutBatch, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """What the rule scorers read: each response decoded without special tokens; for a
    trajectory its last model turn, decoded the same way (so a one-turn trajectory reads as the
    single-turn response does)."""
    ids = [t.final_turn_ids for t in batch.trajectories]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def reward_samples(
    items: Sequence[PromptItem], batch: RolloutBatch, texts: list[str], rows: Sequence[int]
) -> list[RewardSample]:
    """What the scorers read of the samples ``rows``: their prompt row and decoded response."""
    out = []
    for k in rows:
        item = items[batch.prompt_index[k]]
        out.append(
            RewardSample(
                data_source=item.data_source,
                solution_str=texts[k],
                ground_truth=item.ground_truth,
                extra_info=item.extra_info,
                prompt=item.prompt,
            )
        )
    return out


def rule_scores(
    rewards: RewardManager,
    items: Sequence[PromptItem],
    batch: RolloutBatch,
    texts: list[str],
    device: torch.device,
    rows: Sequence[int] | None = None,
) -> tuple[torch.Tensor, dict[str, float], Failures]:
    """One rule score per sample (the reward manager's scorers, on ``device``), their metrics and
    failures; with ``rows`` only those samples are scored (the others get 0)."""
    rows = range(len(texts)) if rows is None else rows
    samples = reward_samples(items, batch, texts, rows)
    out = torch.zeros(len(texts), dtype=torch.float32, device=device)
    if not samples:
        return out, {}, Failures(0, 0)
    result = rewards.score(samples)
    out[list(rows)] = torch.tensor(result.scores, dtype=torch.float32, device=device)
    failures = Failures(
        len(result.failures), len(samples), describe_first(rewards, samples, result)
    )
    return out, dict(result.metrics), failures


def _scored_once_per_model_parallel_group(
    score: Callable[[Sequence[RewardSample]], Scored], samples: Sequence[RewardSample]
) -> Scored:
    """``score(samples)``, called by the first rank of the model-parallel group and broadcast to
    the others (a collective over TP x PP): a service or judge scores each sample once, and ranks
    holding the same samples train on the same scores, even from one that answers the same
    sample differently (a sampling judge, a timeout)."""
    group = parallel.mp_group_if_split()
    if group is None:
        return score(samples)
    leader = dist.get_process_group_ranks(group)[0]
    box: list[Scored | RewardError | None] = [None]
    if dist.get_rank() == leader:
        try:
            box[0] = score(samples)
        except RewardError as e:  # strict mode: every rank of the group raises it
            box[0] = e
    dist.broadcast_object_list(box, src=leader, group=group)
    if isinstance(box[0], RewardError):
        raise box[0]
    assert box[0] is not None
    return box[0]


def batch_scores(
    scorer: BatchScorer,
    items: Sequence[PromptItem],
    batch: RolloutBatch,
    texts: list[str],
    device: torch.device,
    rows: Sequence[int],
) -> tuple[torch.Tensor, dict[str, float], Failures]:
    """A remote service's or a judge's score of the samples ``rows`` (the others get 0), on
    ``device``, its metrics and failures; asked once per model-parallel group."""
    out = torch.zeros(len(texts), dtype=torch.float32, device=device)
    samples = reward_samples(items, batch, texts, rows)
    if not samples:
        return out, {}, Failures(0, 0)
    result = _scored_once_per_model_parallel_group(scorer.score, samples)
    out[list(rows)] = torch.tensor(result.scores, dtype=torch.float32, device=device)
    first = None
    if result.failures:
        failed = result.failures[0]
        first = describe_failure(scorer.name, samples[failed.index], failed)
    return out, result.metrics, Failures(len(result.failures), len(samples), first)


def score_rollout(
    rewards: RewardSources,
    tokenizer: PreTrainedTokenizerBase,
    pad_id: int,
    items: Sequence[PromptItem],
    batch: RolloutBatch,
    batching: MicroBatching,
    shaping: bool = True,
) -> tuple[Samples, torch.Tensor, dict[str, float], list[str]]:
    """Samples of a rollout with their outcome scores: rule scorers, a reward model, a remote
    reward service, a generative judge, or a weighted sum (``reward.rule_weight * rule +
    reward.model_weight * model + reward.remote_weight * remote + reward.judge.weight * judge``),
    plus the overlong penalty
    (``reward.overlong_buffer``) with ``shaping``; also the decoded responses. The metrics are
    this rank's counts and means, each with the count of the samples it is over
    (``reward/rollout_samples`` for those over every sample): :mod:`megarl.rewards.shares`
    combines them over data-parallel ranks.

    A multi-turn trajectory scores the sum of its environment's turn rewards, plus the run's
    reward (rule scorer and/or reward model, as above) on its final conversation unless the
    environment rewarded the final turn itself; one whose environment failed scores 0. Each turn's
    reward sits on the turn's last model token, the run's outcome score (and the overlong
    penalty) on the trajectory's last model token."""
    texts = decode_responses(batch, tokenizer)
    samples = build_samples(items, batch, pad_id, platform.device())
    device = samples.input_ids.device
    trajectories = batch.trajectories if batch.conversations else None
    scored = list(range(samples.size))  # the samples the run's reward scores
    if trajectories is not None:
        scored = [
            k
            for k, t in enumerate(trajectories)
            if not t.env_scored_outcome and t.finish != "error"
        ]
    metrics: dict[str, float] = {ROLLOUT_SAMPLES: float(samples.size)}
    rule = torch.zeros(samples.size, device=device)
    failures: list[Failures] = []
    if rewards.rule_weight != 0:
        rule, rule_metrics, rule_failures = rule_scores(
            rewards.rules, items, batch, texts, device, scored
        )
        metrics.update(rule_metrics)
        if scored:
            metrics["reward/rule_mean"] = float(rule[scored].mean())
        failures.append(rule_failures)
    model = None
    if rewards.model is not None:
        model = score_sequences(
            rewards.model,
            samples.input_ids,
            samples.seq_lens(),
            batching.size,
            pad_id,
            packing=batching.packing,
        )
        metrics["reward/model_mean"] = float(model.mean())
        metrics["reward/model_std"] = float(model.std()) if model.numel() > 1 else 0.0
        failures.append(non_finite_model_scores(model, rewards.model_path))
    remote = None
    if rewards.remote is not None:
        remote, remote_metrics, remote_failures = batch_scores(
            rewards.remote, items, batch, texts, device, scored
        )
        metrics.update(remote_metrics)
        failures.append(remote_failures)
    judged = None
    if rewards.judge is not None:
        judged, judge_metrics, judge_failures = batch_scores(
            rewards.judge, items, batch, texts, device, scored
        )
        metrics.update(judge_metrics)
        failures.append(judge_failures)
    # reward.max_failed_fraction: a broken reward stops the run here, before any update
    stop_on_failed_scores(failures, rewards.max_failed_fraction)
    scores = combine_scores(rule, model, rewards.rule_weight, rewards.model_weight)
    if remote is not None:
        scores = scores + rewards.remote_weight * remote
    if judged is not None:
        scores = scores + rewards.judge_weight * judged
    if trajectories is not None:
        scores, env_metrics = _with_environment_rewards(scores, trajectories)
        metrics.update(env_metrics)
    buf = rewards.overlong
    if shaping and buf.len > 0:
        penalty = overlong_penalty(
            samples.response_lens,
            max_length=rewards.max_response_length,
            buffer_length=buf.len,
            penalty_factor=buf.penalty_factor,
        ).to(scores.device)
        scores = scores + penalty
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
    if trajectories is None:
        set_outcome_scores(samples, scores)
    else:
        set_trajectory_scores(samples, scores, trajectories)
    return samples, scores, metrics, texts


def _with_environment_rewards(
    scores: torch.Tensor, trajectories: Sequence[Trajectory]
) -> tuple[torch.Tensor, dict[str, float]]:
    """The environment's turn rewards, plus the run's outcome score where the environment left
    the final turn unrewarded; 0 for failed samples. Also ``reward/env_mean`` and
    ``reward/env_outcome_share``."""
    out = scores.clone()
    for k, t in enumerate(trajectories):
        if t.finish == "error":
            out[k] = 0.0
        elif t.env_scored_outcome:
            out[k] = t.env_reward
        else:
            out[k] = out[k] + t.env_reward
    n = max(len(trajectories), 1)
    return out, {
        "reward/env_mean": sum(t.env_reward for t in trajectories) / n,
        "reward/env_outcome_share": sum(t.env_scored_outcome for t in trajectories) / n,
    }


def set_outcome_scores(samples: Samples, scores: torch.Tensor) -> None:
    """The outcome reward of each sample, on its last response token."""
    token_scores = torch.zeros_like(samples.response_mask)
    last = (samples.response_lens - 1).clamp(min=0)
    rows = torch.arange(samples.size, device=token_scores.device)
    token_scores[rows, last] = scores.to(token_scores.device) * (samples.response_lens > 0)
    samples.tensors.token_level_scores = token_scores


def set_trajectory_scores(
    samples: Samples,
    scores: torch.Tensor,
    trajectories: Sequence[Trajectory],
) -> None:
    """Token rewards of trajectories: each environment turn reward on that turn's last model
    token, the rest of the score (the run's outcome score, the overlong penalty) on the last
    model token. Their sum per row is ``scores``."""
    token_scores = torch.zeros_like(samples.response_mask)
    values = scores.tolist()
    for k, t in enumerate(trajectories):
        if not t.turn_ends:  # a failed reset: nothing the model wrote, nothing to reward
            continue
        turns = 0.0
        if t.finish != "error":
            for end, r in zip(t.turn_ends, t.turn_rewards, strict=True):
                token_scores[k, end] += float(r or 0.0)
                turns += float(r or 0.0)
        token_scores[k, t.turn_ends[-1]] += values[k] - turns
    samples.tensors.token_level_scores = token_scores


def build_samples(
    items: Sequence[PromptItem], batch: RolloutBatch, pad_id: int, device: torch.device
) -> Samples:
    """The rollout as padded training tensors on ``device`` (the models'), grouped by prompt; a
    trajectory's environment tokens are masked out."""
    groups = [items[i].uid for i in batch.prompt_index]
    return rollout_samples(batch, groups, pad_id, device)


def rollout_samples(
    batch: RolloutBatch, group_ids: Sequence[Hashable], pad_id: int, device: torch.device
) -> Samples:
    """The rollout's sequences as :class:`Samples` with the rollout engine's logprob of each
    response token (``rollout_log_prob``); ``group_ids``: one per sample. A trajectory's
    response mask is 1 on the model's tokens only."""
    prompts = [t.prompt_ids for t in batch.trajectories]
    responses = [t.response_ids for t in batch.trajectories]
    masks = batch.response_masks
    samples = Samples.from_sequences(prompts, responses, group_ids, pad_id, device, masks=masks)
    width = samples.response_mask.shape[1]
    rollout = [t.logprobs + [0.0] * (width - len(t.logprobs)) for t in batch.trajectories]
    samples.tensors.rollout_log_prob = torch.tensor(
        rollout, dtype=torch.float32, device=device
    ).reshape(len(rollout), width)
    routes = batch.routes
    if routes is not None:  # actor.router_replay
        samples.routes = padded_routes(routes, int(samples.input_ids.shape[1]))
    return samples


def compute_experience(
    spec: AlgorithmSpec,
    roles: Roles,
    samples: Samples,
    kl_ctrl: KLController | None,
    batching: MicroBatching,
) -> StepMetrics:
    """Fill ``samples.tensors`` with ref_log_prob, values, token_level_rewards, advantages,
    returns (and teacher_log_prob, rollout_is_weights where their settings ask for them)."""
    metrics: StepMetrics = {}
    t, mask = samples.tensors, samples.response_mask
    vocab = roles.dims.vocab_size
    temperature = spec.temperature
    if roles.has_reference:
        with roles.reference_model() as reference:
            t.ref_log_prob = policy_log_probs(reference, samples, vocab, temperature, batching)
    if roles.critic is not None:
        t.values = forward_response_tensor(roles.critic.model, samples, response_values, batching)
    rewards = t.require("token_level_scores")
    if kl_ctrl is not None:  # algorithm.use_kl_in_reward
        rewards, kl_metrics = apply_kl_in_reward(
            rewards,
            t.require("old_log_prob"),
            t.require("ref_log_prob"),
            mask,
            kl_coef=kl_ctrl.value,
            estimator=spec.kl_in_reward_estimator,
        )
        kl = dp_mean(float(kl_metrics["kl"]))
        kl_ctrl.update(kl, n_steps=spec.kl_ctrl_n_steps)
        metrics.update({"actor/reward_kl": mean(kl), "actor/kl_coef": mean(kl_ctrl.value)})
    t.token_level_rewards = rewards
    extra: dict[str, Any] = {}
    if "values" in spec.advantage_inputs:
        extra["values"] = t.require("values")
    if "group_ids" in spec.advantage_inputs:
        extra["group_ids"] = samples.group_ids
    if "batch_sum" in spec.advantage_inputs:  # batch-wide statistics over every DP rank
        extra["batch_sum"] = dp_sum
    hparams: Mapping[str, Any] = spec.advantage_kwargs  # not group_ids: a float or bool each
    t.advantages, t.returns = compute_advantages(
        spec.adv_estimator,
        token_level_rewards=rewards,
        response_mask=mask,
        **extra,
        **hparams,
    )
    if roles.teacher is not None:  # algorithm.distill: teacher logprobs (and per-token advantages)
        metrics.update(distill_experience(roles.teacher, samples, batching, temperature))
    if spec.rollout_correction != "none":
        weights, correction = compute_rollout_correction(
            spec.rollout_correction,
            t.require("old_log_prob"),
            t.require("rollout_log_prob"),
            mask,
            **spec.rollout_correction_kwargs,
        )
        t.rollout_is_weights = weights  # None: the correction only masks or measures
        metrics.update(declare(correction, ROLLOUT_CORRECTION_REDUCTIONS, prefix="rollout/"))
    if t.values is not None:  # a critic
        metrics.update(_critic_metrics(t.values, t.require("returns"), mask))
    metrics["actor/advantages_mean"] = mean(_batch_token_mean(t.require("advantages"), mask))
    return metrics


def _critic_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> StepMetrics:
    """The critic before this step's update, on a batch it has not seen: the mean of its values
    and of the returns, its squared error, and how much of the returns' variance around their
    mean it explains (collectives over the DP ranks)."""
    metrics: StepMetrics = {
        "critic/values_mean": mean(_batch_token_mean(values, mask)),
        "critic/returns_mean": mean(_batch_token_mean(returns, mask)),
        "critic/value_mse": mean(_batch_token_mean((values - returns).square(), mask)),
    }
    # over every DP rank's tokens: the sums add up, the per-rank ratios would not
    sums = dp_sum(explained_variance_sums(values, returns, mask))
    metrics["critic/explained_var"] = mean(explained_variance_from_sums(sums))
    return metrics


def _batch_token_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean of ``x`` over the valid tokens of every DP rank's samples (a collective), the
    same on every rank: not the mean of each rank's own token means."""
    sums = dp_sum(torch.stack([masked_sum(x, mask), masked_count(mask).to(x.dtype)]))
    return float(sums[0] / sums[1].clamp(min=1))
