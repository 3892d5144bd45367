"""The metrics of a rollout (rewards, response lengths, data, throughput), each with the
reduction over ranks it needs."""

from __future__ import annotations

from typing import Protocol

from megarl.hybrid_engine.mismatch import LOGPROB_MISMATCH_REDUCTIONS
from megarl.metrics import StepMetrics, declare, maximum, mean, minimum
from megarl.trainer.batch import Samples, StepBatch


class CountingData(Protocol):
    """Training data that counts what it filtered (PromptDataset, or an async run's remote one)."""

    def metrics(self) -> dict[str, float]: ...


def rollout_metrics(batch: StepBatch, dataset: CountingData) -> StepMetrics:
    """Rewards and response lengths of this rank's rollout, the reward scorers' and the data's
    counters, and the rollout-vs-trainer logprob mismatch of the scoring pass."""
    samples, scores = batch.samples, batch.scores
    lens = samples.response_lens.float()
    clipped = [r == "length" for r in batch.finish_reasons]
    out = declare(batch.mismatch, LOGPROB_MISMATCH_REDUCTIONS)
    out.update(
        {
            "reward/mean": mean(scores.mean()),
            "reward/std": mean(scores.std()) if scores.numel() > 1 else mean(0.0),
            "reward/max": maximum(scores.max()),
            "reward/min": minimum(scores.min()),
            "response/length_mean": mean(lens.mean()),
            "response/length_max": maximum(lens.max()),
            "response/clip_ratio": mean(sum(clipped) / max(len(clipped), 1)),
            # This rank's trained tokens, heaviest and mean over ranks: their ratio is the
            # step's DP token imbalance (perf/dp_token_imbalance, megarl.run.steps).
            "perf/dp_tokens_max": maximum(samples.seq_lens().sum()),
            "perf/dp_tokens_mean": mean(samples.seq_lens().sum()),
        }
    )
    out.update(declare({k: v for k, v in batch.reward_metrics.items() if k != "reward/mean"}))
    out.update(declare(dataset.metrics()))
    return out


def tokens_in(samples: Samples, dp: int) -> float:
    """Generated + trained tokens of the whole step (all DP ranks)."""
    return float(samples.response_lens.sum() + samples.seq_lens().sum()) * dp
