"""Checkpoint retention: keep_last newest, every keep_every-th, never latest or newer; removal
through a hidden name; leftovers of interrupted saves cleaned."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.run.retention import checkpoint_steps, prune, remove_stale_partials, to_remove

pytestmark = pytest.mark.unit


def test_to_remove_keeps_the_newest_and_every_kth():
    steps = [1, 2, 3, 4, 5, 6, 7, 8]
    assert to_remove(steps, keep_last=2, keep_every=0, protect=set()) == [1, 2, 3, 4, 5, 6]
    assert to_remove(steps, keep_last=2, keep_every=3, protect=set()) == [1, 2, 4, 5]
    assert to_remove(steps, keep_last=1, keep_every=0, protect={3}) == [1, 2, 4, 5, 6, 7]
    assert to_remove([5], keep_last=1, keep_every=0, protect=set()) == []
    with pytest.raises(ValueError, match="keep_last"):
        to_remove(steps, keep_last=0, keep_every=0, protect=set())


def make_root(tmp_path: Path, steps: list[int], latest: int | None) -> Path:
    root = tmp_path / "checkpoints"
    for s in steps:
        (root / f"step_{s:08d}" / "trainer").mkdir(parents=True)
    if latest is not None:
        (root / "latest").write_text(f"step_{latest:08d}\n")
    return root


def test_prune_removes_old_ones_only_behind_latest(tmp_path):
    root = make_root(tmp_path, [2, 4, 6, 8], latest=8)
    removed = prune(root, keep_last=2, keep_every=4)
    assert [p.name for p in removed] == ["step_00000002"]
    assert sorted(checkpoint_steps(root)) == [4, 6, 8]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # nothing left behind


def test_prune_never_removes_latest_or_newer(tmp_path):
    # a newer checkpoint whose `latest` update has not happened yet, and latest itself
    root = make_root(tmp_path, [1, 2, 3, 4], latest=2)
    prune(root, keep_last=1)
    assert sorted(checkpoint_steps(root)) == [2, 3, 4]


def test_prune_does_nothing_without_a_valid_latest(tmp_path):
    root = make_root(tmp_path, [1, 2, 3], latest=None)
    assert prune(root, keep_last=1) == []
    (root / "latest").write_text("step_00000009\n")  # names a missing folder
    assert prune(root, keep_last=1) == []
    assert sorted(checkpoint_steps(root)) == [1, 2, 3]


def test_stale_leftovers_are_removed_and_others_kept(tmp_path):
    root = make_root(tmp_path, [1], latest=1)
    for name in (".step_00000002.partial", ".step_00000001.removing", ".step_00000001.replaced"):
        (root / name / "actor").mkdir(parents=True)
    (root / "notes").mkdir()
    remove_stale_partials(root)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "notes", "step_00000001"]
