"""The reward metrics of a batch scored in shares (one per data-parallel rank, each holding its own
samples) as one score of the whole batch reports them.

:data:`COMBINED` is the one place that says how each reward metric combines: a :class:`Count`
is summed over the shares; a :class:`Mean` is a mean over the samples another key counts, and
each share's mean is weighted by that count; a :class:`Std` (a sample std, Bessel-corrected as
``torch.std``) is pooled from each share's count, mean and std. Besides the table, each data
source's ``reward/<source>/count`` and ``reward/<source>/mean`` (the reward manager's) combine
as a count and a mean over it. Every key the reward sources report that counts or averages the
rank's own samples is named here (a test holds the producers to it: the reward manager, the
remote service, the judge and :func:`megarl.trainer.experience.score_rollout`); a new one goes
into the table with its producer.

The extra metrics a remote service returns with some of its scores combine the same way: each
``reward/remote/<name>`` is a mean over the samples that returned it, counted in
``reward/remote_samples/<name>``.

Not combined (whoever logs it keeps each rank's value): ``reward/mean`` (whoever combines has
the scores themselves). The multi-turn ``rollout/*`` metrics that travel with the reward metrics
are the step's on every rank already.

Under the remote service and the judge, the first rank of each model-parallel group scores and
broadcasts the result to the others (:func:`megarl.trainer.experience.batch_scores`), so every
replica of a DP rank reports the same counters: summed over the DP group they count each
sample once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Count:
    """A number of samples (or of events among them: failures, retries): summed over shares."""


@dataclass(frozen=True)
class Mean:
    """A mean over the samples the key ``over`` counts, in the same metrics."""

    over: str


@dataclass(frozen=True)
class Std:
    """The sample std (Bessel-corrected) of the values whose mean is ``mean``, over the samples
    ``over`` counts."""

    mean: str
    over: str


Combination = Count | Mean | Std

COUNT = Count()
# the rollout's samples that score_rollout rewarded, scored by every source or not (a multi-turn
# trajectory the environment scored itself skips the run's scorers)
ROLLOUT_SAMPLES = "reward/rollout_samples"

COMBINED: dict[str, Combination] = {
    # the reward manager (rule scorers), over the samples it scored
    "reward/samples": COUNT,
    "reward/failures": COUNT,
    "reward/timeouts": COUNT,
    "reward/rule_mean": Mean("reward/samples"),
    # the remote reward service (megarl.rewards.remote)
    "reward/remote_samples": COUNT,
    "reward/remote_failures": COUNT,
    "reward/remote_timeouts": COUNT,
    "reward/remote_retries": COUNT,
    "reward/remote_mean": Mean("reward/remote_samples"),
    # the generative judge (megarl.rewards.judge)
    "reward/judge_samples": COUNT,
    "reward/judge_failures": COUNT,
    "reward/judge_unparsed": COUNT,
    "reward/judge_timeouts": COUNT,
    "reward/judge_mean": Mean("reward/judge_samples"),
    # over every sample of the rollout (megarl.trainer.experience.score_rollout)
    ROLLOUT_SAMPLES: COUNT,
    "reward/model_mean": Mean(ROLLOUT_SAMPLES),
    "reward/model_std": Std("reward/model_mean", ROLLOUT_SAMPLES),
    "reward/overlong_penalty_mean": Mean(ROLLOUT_SAMPLES),
    "reward/env_mean": Mean(ROLLOUT_SAMPLES),
    "reward/env_outcome_share": Mean(ROLLOUT_SAMPLES),
}


def source_mean(source: str) -> str:
    """The key of the mean score of a data source's samples (the reward manager's)."""
    return f"reward/{source}/mean"


def source_count(source: str) -> str:
    """The key of the number of a data source's samples."""
    return f"reward/{source}/count"


REMOTE_EXTRA = "reward/remote/"
REMOTE_EXTRA_COUNT = "reward/remote_samples/"


def remote_extra_mean(name: str) -> str:
    """The key of the mean of an extra metric ``name`` a remote service returned."""
    return REMOTE_EXTRA + name


def remote_extra_count(name: str) -> str:
    """The key of the number of samples a remote service returned ``name`` with."""
    return REMOTE_EXTRA_COUNT + name


def combination(key: str, metrics: Mapping[str, float]) -> Combination | None:
    """How ``key`` of ``metrics`` combines over shares; None: it does not (each share's value
    stands). A data source's count and mean combine where ``metrics`` holds both, and a remote
    service's extra metric where it holds its count."""
    if key in COMBINED:
        return COMBINED[key]
    if key.startswith(REMOTE_EXTRA_COUNT):
        return COUNT
    if key.startswith(REMOTE_EXTRA):
        count = remote_extra_count(key.removeprefix(REMOTE_EXTRA))
        return Mean(count) if count in metrics else None
    for suffix in ("/count", "/mean"):
        source = key.removeprefix("reward/").removesuffix(suffix)
        count, mean = source_count(source), source_mean(source)
        if key in (count, mean) and count in metrics and mean in metrics:
            return COUNT if key == count else Mean(count)
    return None


def pooled_std(parts: Iterable[tuple[float, float, float]]) -> float:
    """The sample std (Bessel-corrected) of values in parts, each given as its count, mean and
    sum of squared deviations from that mean; 0 for fewer than 2 values. Squared deviations,
    not sums of squares: those would lose the std of values far from 0 to cancellation."""
    parts = [p for p in parts if p[0] > 0]
    n = sum(count for count, _, _ in parts)
    if n <= 1:
        return 0.0
    mean = sum(count * m for count, m, _ in parts) / n
    sq_dev = sum(dev + count * (m - mean) ** 2 for count, m, dev in parts)
    return math.sqrt(max(sq_dev, 0.0) / (n - 1))


def combine_shares(shares: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The reward metrics of a batch scored in ``shares`` (e.g. one per data-parallel rank, each
    the metrics its reward sources reported, among others) as one score of the whole batch
    reports them, for the keys :func:`combination` knows; the others are left out.

    A share without a key adds nothing to it (no samples for that source), and shares may hold
    different keys (data sources). A mean or std whose count no share holds (or which counts no
    sample) is left out too."""
    how: dict[str, Combination] = {}
    for share in shares:
        for key in share:
            rule = combination(key, share)
            if rule is not None:
                how[key] = rule
    out: dict[str, float] = {}
    for key, rule in how.items():
        holding = [share for share in shares if key in share]
        if isinstance(rule, Count):
            out[key] = sum(share[key] for share in holding)
            continue
        weighted = [share for share in holding if rule.over in share]
        total = sum(share[rule.over] for share in weighted)
        if total <= 0:
            continue
        if isinstance(rule, Mean):
            out[key] = sum(share[key] * share[rule.over] for share in weighted) / total
        else:
            parts = []
            for share in weighted:
                if rule.mean in share:  # a std's squared deviations: std^2 * (n - 1)
                    n = share[rule.over]
                    parts.append((n, share[rule.mean], share[key] ** 2 * max(n - 1, 0.0)))
            out[key] = pooled_std(parts)
    return dict(sorted(out.items()))
