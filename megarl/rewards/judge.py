"""Scores from a generative judge (``reward.judge``): its prompt per sample, its answers, their
scores and the failures, whatever answers (a local engine or an OpenAI-compatible server).

A sample whose answer never came (an error, a timeout) or holds no score
(:class:`~megarl.rewards.judge_prompt.UnparsedAnswer`) scores 0 and counts as failed, like a
local scorer's failure (``reward.max_failed_fraction``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from megarl.rewards.failures import ScoredBatch, report_failures
from megarl.rewards.judge_prompt import JudgeTemplate, UnparsedAnswer
from megarl.rewards.manager import RewardSample
from megarl.rewards.scoring import ScoreOutcome, Status

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NoAnswer:
    """Why a judge gave no answer to one prompt."""

    status: Status
    message: str


class Answerer(Protocol):
    """What answers the judge's prompts, in order (one answer or :class:`NoAnswer` each)."""

    @property
    def name(self) -> str:
        """The judge as a user names it (its setting and value)."""
        ...

    def answer(self, prompts: Sequence[str]) -> list[str | NoAnswer]: ...


class JudgeScorer:
    """Scores samples with ``answerer``'s answers to ``template``'s prompts."""

    def __init__(self, template: JudgeTemplate, answerer: Answerer, *, strict: bool = False):
        self.template = template
        self.answerer = answerer
        self.strict = strict

    @property
    def name(self) -> str:
        return self.answerer.name

    def score(self, samples: Sequence[RewardSample]) -> ScoredBatch:
        """Every sample's score, in order. Metrics: reward/judge_samples, reward/judge_mean
        (failures as 0), reward/judge_failures, reward/judge_unparsed (answers without a score),
        reward/judge_timeouts. How each combines over data-parallel ranks:
        :mod:`megarl.rewards.shares`."""
        if not samples:
            return ScoredBatch([], {})
        answers = self.answerer.answer([self.template.prompt(s) for s in samples])
        if len(answers) != len(samples):
            raise RuntimeError(f"{self.name} gave {len(answers)} answers to {len(samples)} prompts")
        scores = [0.0] * len(samples)
        failures: list[ScoreOutcome] = []
        unparsed = 0
        for i, answer in enumerate(answers):
            if isinstance(answer, NoAnswer):
                failures.append(ScoreOutcome(i, answer.status, 0.0, answer.message))
                continue
            try:
                scores[i] = self.template.score(answer)
            except UnparsedAnswer as e:
                unparsed += 1
                failures.append(ScoreOutcome(i, "error", 0.0, str(e)))
        if failures:
            report_failures(logger, self.name, self.strict, len(samples), failures)
        metrics = {
            "reward/judge_samples": float(len(samples)),
            "reward/judge_mean": sum(scores) / len(scores),
            "reward/judge_failures": float(len(failures)),
            "reward/judge_unparsed": float(unparsed),
            "reward/judge_timeouts": float(sum(f.status == "timeout" for f in failures)),
        }
        return ScoredBatch(scores, metrics, failures)
