"""One scorer call, guarded: an exception, a bad return value or a soft timeout becomes an outcome.

This module runs both in the trainer's process and in scorer workers, so it imports only the
standard library and the spec loader (a worker must start fast and never import torch).
"""

from __future__ import annotations

import math
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Literal

from megarl.rewards.loading import load_callable

Status = Literal["ok", "error", "timeout"]
CallStyle = Literal["per_source", "custom"]


@dataclass(frozen=True)
class ScoreTask:
    """A sample and the scorer for it.

    style "per_source": `fn(solution_str, ground_truth, **kwargs)` (e.g. gsm8k.compute_score);
    style "custom": verl's custom reward function,
    `fn(data_source=, solution_str=, ground_truth=, extra_info=, **kwargs)`.
    `fn` is a spec string (always, in worker processes) or a function (in-process only).
    """

    index: int
    fn: str | Callable[..., object]
    style: CallStyle
    data_source: str
    solution_str: str
    ground_truth: object
    extra_info: object = None
    kwargs: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreOutcome:
    index: int
    status: Status
    score: float
    message: str = ""


class _SoftTimeout(BaseException):
    """Raised by SIGALRM inside a scorer; a BaseException so `except Exception` in it cannot eat it."""


def _alarm_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def soft_timeout(seconds: float | None) -> Iterator[None]:
    """Interrupt Python code running longer than `seconds` (main thread only; C code that never
    returns to the interpreter is not interrupted: worker processes are killed for that)."""
    if not seconds or not _alarm_usable():
        yield
        return

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise _SoftTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def as_score(value: object) -> float:
    """A scorer's return value as a finite float: a number, a bool, or a dict with a 'score'."""
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"scorer returned a dict without a 'score' key: keys {sorted(value)}")
        value = value["score"]
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        raise TypeError(f"scorer returned {type(value).__name__} {value!r:.60}; return a float")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"scorer returned {out}; return a finite float")
    return out


_loaded: dict[str, Callable[..., object]] = {}


def resolve_scorer(fn: str | Callable[..., object]) -> Callable[..., object]:
    """The scorer a task names, imported once per process."""
    if callable(fn):
        return fn
    if fn not in _loaded:
        _loaded[fn] = load_callable(fn)
    return _loaded[fn]


def run_task(task: ScoreTask, timeout_s: float | None) -> ScoreOutcome:
    """Call the task's scorer; never raises for a scorer's failure."""
    try:
        fn = resolve_scorer(task.fn)
        with soft_timeout(timeout_s):
            if task.style == "custom":
                value = fn(
                    data_source=task.data_source,
                    solution_str=task.solution_str,
                    ground_truth=task.ground_truth,
                    extra_info=task.extra_info,
                    **task.kwargs,
                )
            else:
                value = fn(task.solution_str, task.ground_truth, **task.kwargs)
        return ScoreOutcome(task.index, "ok", as_score(value))
    except _SoftTimeout:
        return ScoreOutcome(task.index, "timeout", 0.0, f"scorer ran past {timeout_s} s")
    except Exception as e:
        tail = "".join(traceback.format_exception(e)[-3:]).strip()
        return ScoreOutcome(task.index, "error", 0.0, f"{type(e).__name__}: {e}\n{tail}")
