"""When failed scores stop a run: more than ``reward.max_failed_fraction`` of a batch's samples
failing to score (the scorer raised, timed out, died, or returned NaN/inf) is a broken reward,
not noise; training on it would learn from zeros. The error names the scorer, its first error and
one offending sample, so the fix is at hand."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from megarl.rewards.manager import RewardError, RewardManager, RewardResult, RewardSample
from megarl.rewards.scoring import ScoreOutcome

SHOWN_CHARS = 200


@dataclass
class ScoredBatch:
    """What a scorer outside the reward manager (a remote service, a judge) gives for a batch:
    per-sample scores (failures score 0), its metrics and one outcome per failure."""

    scores: list[float]
    metrics: dict[str, float]
    failures: list[ScoreOutcome] = field(default_factory=list)


class BatchScorer(Protocol):
    """A remote reward service or a judge, as the trainer calls it."""

    @property
    def name(self) -> str:
        """The scorer as a user names it (its setting and value)."""
        ...

    def score(self, samples: Sequence[RewardSample]) -> ScoredBatch: ...


def report_failures(
    log: logging.Logger,
    name: str,
    strict: bool,
    total: int,
    failures: Sequence[ScoreOutcome],
    detail: str = "",
) -> None:
    """A batch's failed samples, once: a RewardError in strict mode, else a warning on ``log``
    with the first one (``detail``: what else the count says, e.g. its timeouts)."""
    first = failures[0]
    if strict:
        raise RewardError(
            f"{name} failed on sample {first.index} ({first.status}): {first.message}\n"
            "(strict mode; with strict=False failures score 0 and are counted)"
        )
    log.warning(
        "reward: %s: %d of %d samples failed%s and scored 0; first, sample %d: %s",
        name,
        len(failures),
        total,
        detail,
        first.index,
        first.message,
    )


@dataclass(frozen=True)
class Failures:
    """One rank's failed scores in a batch; ``first`` describes its first failure."""

    failed: int
    total: int
    first: str | None = None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def describe_first(
    manager: RewardManager, samples: Sequence[RewardSample], result: RewardResult
) -> str | None:
    """The scorer, the first error and the sample it failed on, for the error message."""
    if not result.failures:
        return None
    first = result.failures[0]
    sample = samples[first.index]
    return describe_failure(manager.scorer_name(sample.data_source), sample, first)


def describe_failure(scorer: str, sample: RewardSample, outcome: ScoreOutcome) -> str:
    """``scorer`` (as a user names it), its error on ``sample`` and the sample."""
    message = outcome.message.strip()
    error = message.splitlines()[0] if message else outcome.status
    return (
        f"scorer: {scorer}; first error ({outcome.status}): "
        f"{error}; on the sample with data_source {sample.data_source!r}, response "
        f"{_short(sample.solution_str)}, ground truth {_short(sample.ground_truth)}"
    )


def too_many_failed(failed: int, total: int, max_fraction: float) -> bool:
    return total > 0 and failed / total > max_fraction


def failed_scores_error(failed: int, total: int, max_fraction: float, first: str) -> RewardError:
    return RewardError(
        f"{failed} of {total} samples ({failed / total:.0%}) failed to score, more than "
        f"reward.max_failed_fraction={max_fraction:g} allows; the run stops before training on "
        f"them (the last checkpoint is kept). {first}. Fix the scorer (a NaN or inf score counts "
        "as a failure), or raise reward.max_failed_fraction (1.0: never stop)"
    )
