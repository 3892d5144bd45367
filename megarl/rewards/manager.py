"""The reward manager: each sample to the scorer of its `data_source`, failures counted.

A scorer that raises, returns something that is not a finite number, runs past `timeout_s`, or
kills its worker process gives that sample reward 0 and is counted and logged; the run goes on
unless too many fail (`reward.max_failed_fraction`, :mod:`megarl.rewards.failures`).
`strict=True` turns the first such failure into a RewardError instead (for debugging scorers).
A sample whose data_source has no scorer is a configuration error and is refused up front.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from megarl.errors import ConfigError, MegarlError
from megarl.rewards.loading import load_callable, spec_of
from megarl.rewards.pool import ScorerPool
from megarl.rewards.registry import BUILTIN_SCORERS
from megarl.rewards.scoring import ScoreOutcome, ScoreTask, run_task
from megarl.rewards.shares import source_count, source_mean

logger = logging.getLogger(__name__)

Scorer = str | Callable[..., object]


class RewardError(MegarlError):
    """A scorer failed while the manager is in strict mode."""


@dataclass(frozen=True)
class RewardSample:
    """What a scorer needs about one generated response."""

    data_source: str
    solution_str: str
    ground_truth: object
    extra_info: object = None
    prompt: object = None  # the prompt row's text or chat messages (what a remote service reads)


@dataclass
class RewardResult:
    """Per-sample scores (failures score 0) and metrics for the batch.

    metrics: reward/mean, reward/samples, reward/failures, reward/timeouts, and
    reward/<data_source>/mean and /count for each data source in the batch.
    """

    scores: list[float]
    metrics: dict[str, float]
    failures: list[ScoreOutcome] = field(default_factory=list)


class RewardManager:
    """Routes samples by data_source to rule scorers, in-process or in a pool of worker processes.

    scorers: data_source -> scorer, on top of the built-ins (BUILTIN_SCORERS), each a
        'module:function' or 'file.py:function' spec or a function, called as
        fn(solution_str, ground_truth, **scorer_kwargs[data_source]).
    custom_fn: one scorer for every sample, called verl-style as
        fn(data_source=, solution_str=, ground_truth=, extra_info=); it overrides the routing.
    num_workers: 0 scores in this process; N > 0 in N worker processes (for slow scorers).
    timeout_s: per-sample limit (None: none). In-process, only Python code on the main thread
        can be interrupted; workers stuck in C code are killed `grace_s` after the limit.
    """

    def __init__(
        self,
        scorers: Mapping[str, Scorer] | None = None,
        *,
        custom_fn: Scorer | None = None,
        scorer_kwargs: Mapping[str, Mapping[str, object]] | None = None,
        include_builtin: bool = True,
        num_workers: int = 0,
        timeout_s: float | None = 30.0,
        grace_s: float = 2.0,
        strict: bool = False,
        mp_context: str = "spawn",
    ) -> None:
        if num_workers < 0:
            raise ConfigError(f"reward num_workers must be >= 0, got {num_workers}.")
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"reward timeout_s must be > 0 or None, got {timeout_s}.")
        table: dict[str, Scorer] = dict(BUILTIN_SCORERS) if include_builtin else {}
        table.update(scorers or {})
        self.num_workers = num_workers
        self.scorers = {
            ds: self._prepare(fn, f"scorer for data_source '{ds}'") for ds, fn in table.items()
        }
        self.custom_fn = None if custom_fn is None else self._prepare(custom_fn, "custom_fn")
        self.scorer_kwargs = {k: dict(v) for k, v in (scorer_kwargs or {}).items()}
        self.timeout_s = timeout_s
        self.strict = strict
        self._pool = (
            ScorerPool(num_workers, timeout_s=timeout_s, grace_s=grace_s, mp_context=mp_context)
            if num_workers > 0
            else None
        )
        self.totals: dict[str, int] = defaultdict(int)

    def _prepare(self, fn: Scorer, what: str) -> Scorer:
        """Load specs now, so a bad spec fails at start-up; pool workers get specs, not functions."""
        if isinstance(fn, str):
            load_callable(fn)
            return fn
        if not callable(fn):
            raise ConfigError(f"{what}: {fn!r} is neither a callable nor a 'module:function' spec.")
        if self.num_workers > 0:
            spec = spec_of(fn)
            if spec is None:
                raise ConfigError(
                    f"{what}: {fn!r} cannot be imported by worker processes (a lambda, a local "
                    "function or one defined in __main__); give it as 'module:function' or "
                    "'file.py:function', or set num_workers=0."
                )
            return spec
        return fn

    def scorer_name(self, data_source: str) -> str:
        """Which scorer scores ``data_source``, as a user would name it."""
        fn = self.custom_fn if self.custom_fn is not None else self.scorers.get(data_source)
        name = fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))
        if self.custom_fn is not None:
            return f"reward.custom_fn={name}"
        return f"the built-in scorer of data_source {data_source!r} ({name})"

    def _tasks(self, samples: Sequence[RewardSample]) -> list[ScoreTask]:
        tasks = []
        for i, s in enumerate(samples):
            if self.custom_fn is not None:
                fn, style = self.custom_fn, "custom"
            elif s.data_source in self.scorers:
                fn, style = self.scorers[s.data_source], "per_source"
            else:
                raise ConfigError(
                    f"no scorer for data_source '{s.data_source}' (sample {i}); known: "
                    f"{sorted(self.scorers)}. Set reward.custom_fn to a scorer for it (or pass "
                    f"scorers={{'{s.data_source}': 'module:function'}} to the RewardManager)."
                )
            tasks.append(
                ScoreTask(
                    index=i,
                    fn=fn,
                    style=style,  # type: ignore[arg-type]
                    data_source=s.data_source,
                    solution_str=s.solution_str,
                    ground_truth=s.ground_truth,
                    extra_info=s.extra_info,
                    kwargs=self.scorer_kwargs.get(s.data_source, {}),
                )
            )
        return tasks

    def score(self, samples: Sequence[RewardSample]) -> RewardResult:
        """Score every sample; see the class docstring for what happens on failures."""
        tasks = self._tasks(samples)
        if self._pool is not None:
            outcomes = self._pool.run(tasks)
        else:
            outcomes = [run_task(t, self.timeout_s) for t in tasks]
        failures = [o for o in outcomes if o.status != "ok"]
        if failures:
            self._report(samples, failures)
        scores = [o.score for o in outcomes]
        return RewardResult(scores, self._metrics(samples, outcomes), failures)

    def _report(self, samples: Sequence[RewardSample], failures: list[ScoreOutcome]) -> None:
        first = failures[0]
        source = samples[first.index].data_source
        timeouts = sum(o.status == "timeout" for o in failures)
        self.totals["failures"] += len(failures)
        self.totals["timeouts"] += timeouts
        if self.strict:
            raise RewardError(
                f"scorer for data_source '{source}' failed on sample {first.index} "
                f"({first.status}): {first.message}\n(strict mode; with strict=False failures "
                "score 0 and are counted)"
            )
        logger.warning(
            "reward: %d of %d samples failed (%d timeouts) and scored 0; first, sample %d "
            "(data_source %r): %s",
            len(failures),
            len(samples),
            timeouts,
            first.index,
            source,
            first.message,
        )

    @staticmethod
    def _metrics(
        samples: Sequence[RewardSample], outcomes: Sequence[ScoreOutcome]
    ) -> dict[str, float]:
        n = len(outcomes)
        metrics = {
            "reward/mean": sum(o.score for o in outcomes) / n if n else 0.0,
            "reward/samples": float(n),
            "reward/failures": float(sum(o.status != "ok" for o in outcomes)),
            "reward/timeouts": float(sum(o.status == "timeout" for o in outcomes)),
        }
        by_source: dict[str, list[float]] = defaultdict(list)
        for s, o in zip(samples, outcomes, strict=True):
            by_source[s.data_source].append(o.score)
        for source, values in sorted(by_source.items()):
            metrics[source_mean(source)] = sum(values) / len(values)
            metrics[source_count(source)] = float(len(values))
        return metrics

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
