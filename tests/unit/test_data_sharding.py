"""The pure shard plan: disjoint, complete, balanced, deterministic, row-group aligned."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.data.sharding import (
    keyed_permutation,
    plan_windows,
    shard_pieces,
    share_bounds,
    steps_per_epoch,
)

# Several files with uneven row groups (the last group of each file is short).
UNEVEN = [[10, 10, 10, 7], [5], [16, 16, 9], [3, 3, 3, 3, 1]]


def rows_of(pieces) -> list[tuple[int, int, int]]:
    return [(p.file, p.row_group, r) for p in pieces for r in range(p.start, p.stop)]


def check_partition(
    groups: list[list[int]], dp_size: int, seed: int, epoch: int, shuffle: bool = True
) -> None:
    everything = {
        (f, g, r) for f, sizes in enumerate(groups) for g, n in enumerate(sizes) for r in range(n)
    }
    shares = [
        rows_of(shard_pieces(groups, rank, dp_size, seed=seed, epoch=epoch, shuffle=shuffle))
        for rank in range(dp_size)
    ]
    counts = Counter(row for share in shares for row in share)
    assert set(counts) == everything, "the shares' union is the dataset"
    assert max(counts.values(), default=1) == 1, "no row is in two shares"
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1, f"shares are balanced to one row: {sizes}"
    for rank in range(dp_size):
        pieces = shard_pieces(groups, rank, dp_size, seed=seed, epoch=epoch, shuffle=shuffle)
        partial = [p for p in pieces if p.num_rows != groups[p.file][p.row_group]]
        assert len(partial) <= 2, "a rank reads whole row groups but at most one at each end"
        assert len({(p.file, p.row_group) for p in pieces}) == len(pieces)


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_shares_are_disjoint_complete_and_balanced(dp_size: int) -> None:
    for epoch in range(3):
        check_partition(UNEVEN, dp_size, seed=7, epoch=epoch)
    check_partition(UNEVEN, dp_size, seed=7, epoch=0, shuffle=False)


@settings(max_examples=150, deadline=None)
@given(
    groups=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6), min_size=1, max_size=5),
    dp_size=st.integers(1, 6),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 50),
)
def test_partition_property(groups: list[list[int]], dp_size: int, seed: int, epoch: int) -> None:
    check_partition(groups, dp_size, seed, epoch)


def test_same_seed_same_plan_and_each_epoch_reshuffles() -> None:
    plan = lambda seed, epoch: [  # noqa: E731
        rows_of(shard_pieces(UNEVEN, r, 3, seed=seed, epoch=epoch)) for r in range(3)
    ]
    assert plan(1, 0) == plan(1, 0)
    assert plan(1, 0) != plan(1, 1), "epochs move row groups between ranks"
    assert plan(1, 0) != plan(2, 0)


def test_unshuffled_plan_is_contiguous_in_file_order() -> None:
    pieces = shard_pieces([[4, 4], [4]], 1, 2, seed=0, epoch=0, shuffle=False)
    assert rows_of(pieces) == [(0, 1, 2), (0, 1, 3), (1, 0, 0), (1, 0, 1), (1, 0, 2), (1, 0, 3)]


def test_keyed_permutation_is_pinned() -> None:
    """Resuming on another machine or numpy release must replay the same order: pin the values."""
    assert keyed_permutation(10, 1, 2).tolist() == [3, 9, 7, 2, 6, 8, 1, 4, 5, 0]
    assert keyed_permutation(12, 0).tolist() == [1, 4, 3, 11, 0, 9, 5, 6, 2, 8, 10, 7]
    assert sorted(keyed_permutation(1000, 5).tolist()) == list(range(1000))
    assert keyed_permutation(1000, 5).tolist() != keyed_permutation(1000, 6).tolist()


def test_windows_hold_at_least_window_rows_and_permute_within() -> None:
    pieces = shard_pieces(UNEVEN, 0, 1, seed=3, epoch=0)
    windows = plan_windows(pieces, window_rows=20, seed=3, epoch=0, dp_rank=0)
    assert [p for w in windows for p in w.pieces] == pieces
    assert all(w.num_rows >= 20 for w in windows[:-1])
    for w in windows:
        assert sorted(w.order.tolist()) == list(range(w.num_rows))
    assert any(not np.array_equal(w.order, np.arange(w.num_rows)) for w in windows)
    again = plan_windows(pieces, window_rows=20, seed=3, epoch=0, dp_rank=0)
    assert all(np.array_equal(a.order, b.order) for a, b in zip(windows, again, strict=True))
    plain = plan_windows(pieces, window_rows=20, seed=3, epoch=0, dp_rank=0, shuffle=False)
    assert all(np.array_equal(w.order, np.arange(w.num_rows)) for w in plain)


@pytest.mark.parametrize(
    ("total", "dp", "batch", "drop_last", "steps"),
    [
        (101, 4, 5, True, 5),
        (101, 4, 5, False, 6),
        (100, 4, 5, True, 5),
        (9, 2, 2, False, 3),
        (3, 4, 1, True, 0),
    ],
)
def test_steps_per_epoch_is_the_same_on_every_rank(
    total: int, dp: int, batch: int, drop_last: bool, steps: int
) -> None:
    assert steps_per_epoch(total, dp, batch, drop_last) == steps


def test_bad_rank_or_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="dp_rank must be in"):
        share_bounds(10, 2, 2)
    with pytest.raises(ValueError, match="batch_size_per_rank must be >= 1"):
        steps_per_epoch(10, 1, 0, True)
