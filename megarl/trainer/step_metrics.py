"""The metrics of a rollout (rewards, response lengths, data, throughput), each with the
reduction over ranks it needs.

Means, stds and counts of the step's samples are combined over the data-parallel ranks here
(:func:`step_statistics`), not left to :func:`megarl.metrics.reduce_metrics`: that one averages
or sums each rank's value over the whole world, which counts a DP rank's model-parallel replicas
once each and gives every DP rank's mean the same weight, however many samples it holds
(dynamic sampling and ``actor.balance_dp_tokens`` make the shares unequal). Combined here, they
are what one process holding all the step's samples reports, at any layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megarl.metrics import StepMetrics, declare, maximum, mean, minimum
from megarl.rewards.shares import combine_shares, pooled_std
from megarl.trainer.batch import Samples, StepBatch
from megarl.trainer.dp_collectives import dp_gather


@dataclass(frozen=True)
class RolloutShare:
    """What one DP rank's samples add to the step's statistics: counts and sums, which add up
    exactly, and the scores' squared deviations from this share's own mean (combined with the
    shares' means: a sum of squares would lose the std of scores far from 0 to cancellation)."""

    samples: int
    score_sum: float
    score_sq_dev: float
    length_sum: float
    finished: int  # samples with a finish reason
    clipped: int  # of which cut at the length limit
    rewards: dict[str, float]  # the reward sources' metrics of these samples

    @classmethod
    def of(cls, batch: StepBatch) -> RolloutShare:
        scores = batch.scores.double()
        n = int(scores.numel())
        return cls(
            samples=n,
            score_sum=float(scores.sum()),
            score_sq_dev=float((scores - scores.mean()).square().sum()) if n else 0.0,
            length_sum=float(batch.samples.response_lens.double().sum()),
            finished=len(batch.finish_reasons),
            clipped=sum(r == "length" for r in batch.finish_reasons),
            rewards=dict(batch.reward_metrics),
        )


def step_statistics(shares: Sequence[RolloutShare]) -> StepMetrics:
    """The step's reward mean and sample std (Bessel-corrected, as torch.std), mean response
    length, clip ratio and the reward sources' counts, means and stds (each combined as
    :mod:`megarl.rewards.shares` declares), from every DP rank's share. Every rank gets the same
    values, so the mean over ranks keeps them."""
    n = sum(s.samples for s in shares)
    parts = [(s.samples, s.score_sum / s.samples, s.score_sq_dev) for s in shares if s.samples]
    finished = sum(s.finished for s in shares)
    out = {
        "reward/mean": mean(sum(s.score_sum for s in shares) / max(n, 1)),
        "reward/std": mean(pooled_std(parts)),
        "response/length_mean": mean(sum(s.length_sum for s in shares) / max(n, 1)),
        "response/clip_ratio": mean(sum(s.clipped for s in shares) / max(finished, 1)),
    }
    out.update(declare(combine_shares([s.rewards for s in shares])))
    return out


def rollout_metrics(batch: StepBatch, data_metrics: Mapping[str, float]) -> StepMetrics:
    """Rewards and response lengths of the step's rollout, the reward scorers' and the data's
    counters (``data_metrics``: the rollout source's). A collective over the data-parallel group
    (:func:`step_statistics`)."""
    samples, scores = batch.samples, batch.scores
    lens = samples.response_lens.float()
    step = step_statistics(dp_gather(RolloutShare.of(batch)))
    out = dict(step)
    out.update(
        {
            "reward/max": maximum(scores.max()),
            "reward/min": minimum(scores.min()),
            "response/length_max": maximum(lens.max()),
            # This rank's trained tokens, heaviest and mean over ranks: their ratio is the
            # step's DP token imbalance (perf/dp_token_imbalance, megarl.run.steps).
            "perf/dp_tokens_max": maximum(samples.seq_lens().sum()),
            "perf/dp_tokens_mean": mean(samples.seq_lens().sum()),
        }
    )
    # the reward metrics megarl.rewards.shares leaves alone (a remote service's extra metrics,
    # the multi-turn rollout/*, the step's on every rank already): each rank's value
    out.update(declare({k: v for k, v in batch.reward_metrics.items() if k not in step}))
    out.update(declare(data_metrics))
    return out


def tokens_in(samples: Samples, dp: int) -> float:
    """Generated + trained tokens of the whole step (all DP ranks)."""
    return float(samples.response_lens.sum() + samples.seq_lens().sum()) * dp
