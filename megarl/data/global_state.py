"""A dataset position in global terms: the states of every data-parallel rank of the layout the
current epoch was planned with, so a run can resume it at another data-parallel size.

Each rank reports ``state_dict()`` (its own :class:`DataState`, or, while it finishes an epoch
planned at another size, the states of the old ranks it stands in for); :func:`merge_rank_states`
turns the reports of all ranks into one record; ``load_state_dict`` of a dataset takes that record
and picks what the rank needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megarl.data.errors import DataError

GLOBAL_FORMAT = "megarl.data.global_state/1"


def is_global(state: object) -> bool:
    return isinstance(state, dict) and state.get("format") == GLOBAL_FORMAT


def global_state(dp_size: int, ranks: Sequence[dict[str, object]]) -> dict[str, object]:
    return {"format": GLOBAL_FORMAT, "dp_size": int(dp_size), "ranks": list(ranks)}


def merge_rank_states(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One global record from every rank's ``state_dict()`` (ranks of one DP rank repeat it)."""
    by_rank: dict[int, dict[str, Any]] = {}
    sizes = set()
    for report in reports:
        parts = report["ranks"] if is_global(report) else [report]
        sizes.add(int(report["dp_size"]))
        for part in parts:
            by_rank.setdefault(int(part["dp_rank"]), part)
    if len(sizes) != 1:
        raise DataError(
            f"data states of different data-parallel sizes {sorted(sizes)} cannot merge"
        )
    size = sizes.pop()
    missing = [r for r in range(size) if r not in by_rank]
    if missing:
        raise DataError(f"data states of data-parallel ranks {missing} are missing")
    return global_state(size, [by_rank[r] for r in range(size)])
