"""Pure shard plans: which rows of which row groups a data-parallel rank reads, in which order.

Everything here is a function of (row-group sizes, dp_rank, dp_size, seed, epoch), so every rank
computes the same global plan from file footers alone and keeps its own part; no rank reads
another's rows and no communication is needed.

The plan for one epoch:
1. Order all row groups (files in the order given, row groups in file order), shuffled per epoch
   from the seed when shuffling.
2. Lay them end to end and cut the row sequence into `dp_size` contiguous ranges whose sizes
   differ by at most one row. Rank r's share is whole row groups plus at most one partial row
   group at each end, so it reads about its share plus at most two row groups.
3. Group the rank's pieces into windows of at least `window_rows` rows and shuffle rows inside
   each window. A rank holds one window in memory at a time.

Permutations come from a keyed 64-bit hash (splitmix64) sorted with a stable sort, not from a
library RNG, so a plan is the same on every machine and every numpy release: a run resumed
elsewhere sees exactly the rows it would have seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_MASK = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> np.uint64:
    k = np.array([0x9E3779B97F4A7C15], dtype=np.uint64)
    for p in parts:
        k = _mix(k ^ np.array([p & _MASK], dtype=np.uint64))
    return k[0]


def keyed_permutation(n: int, *key: int) -> np.ndarray:
    """A permutation of range(n) determined only by `key` (ints), stable across platforms."""
    with np.errstate(over="ignore"):
        idx = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return np.argsort(_mix(idx ^ _key(*key)), kind="stable")


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of row group `row_group` of file `file` (indices into the file list)."""

    file: int
    row_group: int
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Window:
    """Consecutive pieces of a share, read together; `order[i]` is the window row served i-th."""

    pieces: tuple[Piece, ...]
    order: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.order)


def share_bounds(total_rows: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """Rank's [begin, end) in the epoch's row sequence; sizes differ by at most one row."""
    _check_rank(dp_rank, dp_size)
    return dp_rank * total_rows // dp_size, (dp_rank + 1) * total_rows // dp_size


def _check_rank(dp_rank: int, dp_size: int) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"dp_rank must be in [0, dp_size); got dp_rank={dp_rank}, dp_size={dp_size}"
        )


def epoch_row_groups(
    row_group_rows: Sequence[Sequence[int]], seed: int, epoch: int, shuffle: bool
) -> list[tuple[int, int, int]]:
    """All non-empty row groups as (file, row_group, rows), in this epoch's global order."""
    groups = [
        (f, g, n) for f, sizes in enumerate(row_group_rows) for g, n in enumerate(sizes) if n > 0
    ]
    if shuffle:
        groups = [groups[i] for i in keyed_permutation(len(groups), seed, epoch, 0)]
    return groups


def shard_pieces(
    row_group_rows: Sequence[Sequence[int]],
    dp_rank: int,
    dp_size: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
) -> list[Piece]:
    """The pieces of rank `dp_rank`'s share for `epoch` (see the module docstring)."""
    groups = epoch_row_groups(row_group_rows, seed, epoch, shuffle)
    total = sum(n for _, _, n in groups)
    begin, end = share_bounds(total, dp_rank, dp_size)
    pieces, offset = [], 0
    for f, g, n in groups:
        lo, hi = max(begin, offset), min(end, offset + n)
        if lo < hi:
            pieces.append(Piece(f, g, lo - offset, hi - offset))
        offset += n
        if offset >= end:
            break
    return pieces


def plan_windows(
    pieces: Sequence[Piece],
    *,
    window_rows: int,
    seed: int,
    epoch: int,
    dp_rank: int,
    shuffle: bool = True,
) -> list[Window]:
    """Group consecutive pieces into windows of >= `window_rows` rows; shuffle rows inside each."""
    if window_rows < 1:
        raise ValueError(f"window_rows must be >= 1, got {window_rows}")
    windows: list[Window] = []
    current: list[Piece] = []
    rows = 0

    def close() -> None:
        order = (
            keyed_permutation(rows, seed, epoch, 1, dp_rank, len(windows))
            if shuffle
            else np.arange(rows)
        )
        windows.append(Window(tuple(current), order))

    for p in pieces:
        current.append(p)
        rows += p.num_rows
        if rows >= window_rows:
            close()
            current, rows = [], 0
    if current:
        close()
    return windows


def steps_per_epoch(total_rows: int, dp_size: int, batch_size: int, drop_last: bool) -> int:
    """Batches per rank per epoch, the same on every rank (ranks must step in lockstep).

    With `drop_last`, only full batches count: the smallest share decides, so each rank leaves
    fewer than `batch_size` + 1 rows of its share unused that epoch. Without it the largest share
    decides, and a rank's last batch may be short or empty.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size_per_rank must be >= 1, got {batch_size}")
    smallest, largest = total_rows // dp_size, -(-total_rows // dp_size)
    return smallest // batch_size if drop_last else -(-largest // batch_size)
