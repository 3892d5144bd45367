"""Repeated, alternated runs of a benchmark's sides: each round runs every side once, in the
order reversed from the previous round's, so that no side always runs first (on a cold page
cache) or last (after the machine has warmed). Each run records the load around it; the stored
file keeps every run, the ratio of each round and their median."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from typing import TypedDict


class RoundRatios(TypedDict):
    rounds: list[float]  # each round's ratio, in the order the rounds ran
    median: float


def order_of(sides: Sequence[str], round_index: int) -> list[str]:
    """The sides in the order round ``round_index`` (0-based) runs them."""
    return list(sides) if round_index % 2 == 0 else list(sides)[::-1]


def run_rounds(
    sides: Sequence[str], rounds: int, run: Callable[[str], dict]
) -> list[dict[str, dict]]:
    """``rounds`` rounds of ``run(side)`` for every side, alternated; each result gains the
    1-minute load at its start and end (``load``). Returned per round, keyed by side."""
    out = []
    for k in range(rounds):
        order = order_of(sides, k)
        print(f"round {k + 1}/{rounds}: {', '.join(order)}", flush=True)
        results = {}
        for side in order:
            load0 = os.getloadavg()[0]
            results[side] = {**run(side), "load": (load0, os.getloadavg()[0])}
        out.append({side: results[side] for side in sides})
    return out


def print_rounds(rounds: list[dict[str, dict]], describe: Callable[[dict], str]) -> None:
    """One line per run: its round, its side, ``describe(run)`` and the load around it."""
    width = max(len(side) for run in rounds for side in run)
    for k, runs in enumerate(rounds):
        for side, r in runs.items():
            load = f"load {r['load'][0]:.1f}-{r['load'][1]:.1f}"
            print(f"  round {k + 1} {side:{width}s} {describe(r)}  {load}")


def print_ratio(label: str, ratio: RoundRatios) -> None:
    each = ", ".join(f"{x:.2f}" for x in ratio["rounds"])
    print(f"  {label}: {each} by round, median {ratio['median']:.2f}")


def ratio_by_round(
    rounds: list[dict[str, dict]], ratio: Callable[[dict[str, dict]], float]
) -> RoundRatios:
    """``ratio`` of each round's runs, and their median."""
    each = [ratio(r) for r in rounds]
    return {"rounds": each, "median": statistics.median(each)}
