"""When ``bench/learn.py``'s sides validate: on one training-clock cadence, alike for both.

A side validates before its first step and then at the first step end at or after each multiple
of ``every_s`` seconds of its training clock (the sum of its step times), and at the first step
end at or after the budget, where it stops. A cadence in steps would sample a side with slow
steps more coarsely in time than one with fast steps, and "time to reach an accuracy" would lean
to the fast one.

Imported by the TRL worker inside its virtualenv (bench/_trl_learn_worker.py, no megarl there)
and by the bench (bench/learn.py, bench/learn_report.py): standard library only.
"""

from __future__ import annotations

import math


def next_due(clock_s: float, every_s: float) -> float:
    """The training clock at which the validation after one at ``clock_s`` is due."""
    return (math.floor(clock_s / every_s) + 1) * every_s


def due(clock_s: float, due_s: float, budget_s: float) -> bool:
    """Whether a step ending at ``clock_s`` validates (``due_s``: from ``next_due``)."""
    return clock_s >= due_s or clock_s >= budget_s


def on_cadence(validations: list[dict], every_s: float, budget_s: float) -> list[dict]:
    """The validations (each with ``step`` and ``clock_s``, in step order) that the cadence
    picks: the one before training, then the first at or after each due time, up to the first
    at or after the budget. A side that validates every step gives the same points as one that
    validates on the cadence itself."""
    kept: list[dict] = []
    due_s = 0.0
    for point in validations:
        if not due(point["clock_s"], due_s, budget_s):
            continue
        kept.append(point)
        due_s = next_due(point["clock_s"], every_s)
        if point["step"] > 0 and point["clock_s"] >= budget_s:
            break
    return kept
