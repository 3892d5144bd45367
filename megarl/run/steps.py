"""The per-step bookkeeping of both trainers: reduce the step's metrics, log them, keep history."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

from megarl.console import announce
from megarl.metrics import Metric, StepMetrics, mean, reduce_metrics
from megarl.run import watchdog
from megarl.run.elastic import elastic_metrics
from megarl.run.tracking import Tracker


def announce_steps(first: int, total: int) -> None:
    """The start-up line that ends the start-up: which step comes first (or none to run)."""
    if first >= total:
        announce(f"nothing to run: the run is at step {first} of trainer.total_steps={total}")
    else:
        announce(f"first step: {first + 1} of {total}")


TIMING = "timing/"  # the prefix of every phase's wall time, ``timing/<phase>_s``


@dataclass
class PhaseTime:
    """The wall time of one run of a step's phase, known once its body has ended."""

    phase: str
    seconds: float = 0.0

    def metrics(self) -> StepMetrics:
        """``timing/<phase>_s``, the mean over ranks."""
        return {f"{TIMING}{self.phase}_s": mean(self.seconds)}


@contextmanager
def timed(phase: str) -> Iterator[PhaseTime]:
    """Times the body as ``phase``: the :class:`PhaseTime` it yields holds the body's wall time
    once the body ends (its :meth:`~PhaseTime.metrics` go into the phase's returned metrics); the
    hang watchdog watches the body as ``phase``."""
    t0 = time.perf_counter()
    took = PhaseTime(phase)
    with watchdog.phase(phase):
        yield took
    took.seconds = time.perf_counter() - t0


def merge_repeated(earlier: StepMetrics, later: StepMetrics) -> StepMetrics:
    """The metrics of phases that ran again in one step (dynamic sampling's draws): ``later``'s
    values over ``earlier``'s, except the timings (``timing/*``), which add up to the phase's
    time in the step."""
    out = earlier | later
    for key, metric in later.items():
        if key.startswith(TIMING) and key in earlier:
            out[key] = replace(metric, value=earlier[key].value + metric.value)
    return out


def log_step(
    tracker: Tracker,
    history: list[dict[str, float]],
    metrics: Mapping[str, Metric],
    step: int,
    total: int,
    first_step: int,
) -> dict[str, float]:
    """Reduce ``metrics`` over ranks, log them as step ``step + 1``, print progress; collective."""
    reduced = reduce_metrics(metrics)
    reduced.update(derived_metrics(reduced))
    reduced.update(elastic_metrics())  # restart count and layout, in an elastic job
    tracker.log_metrics(reduced, step + 1)
    tracker.progress(step, total, reduced, first_step)
    history.append(reduced)
    return reduced


def derived_metrics(reduced: Mapping[str, float]) -> dict[str, float]:
    """Metrics that exist only after the reduction over ranks: ``perf/dp_token_imbalance``, the
    heaviest data-parallel rank's trained tokens over the mean, minus one (0: even)."""
    out: dict[str, float] = {}
    top, avg = reduced.get("perf/dp_tokens_max"), reduced.get("perf/dp_tokens_mean")
    if top is not None and avg:
        out["perf/dp_token_imbalance"] = top / avg - 1.0
    return out


def summary(
    history: list[dict[str, float]], key: str, last: Mapping[str, float] | None = None
) -> str:
    """``key``'s value at the first and last step (``last``: the last step's metrics if given)."""
    if not history:
        return "no steps run"
    end = (last if last is not None else history[-1]).get(key, float("nan"))
    first = history[0].get(key, float("nan"))
    return f"{key}: first step {first:.4f}, last step {end:.4f} over {len(history)} steps"
