"""Stage-then-rename (megarl.checkpoint.atomic): every file and folder of the stage is flushed
before the rename, a replaced folder goes aside and is removed, a failed rename leaves the old
folder in place; both checkpoint writers publish through it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megarl.checkpoint import atomic, store
from megarl.checkpoint.atomic import aside_name, publish
from megarl.run import checkpointing

pytestmark = pytest.mark.unit


def staged(root: Path, name: str, text: str) -> Path:
    stage = root / f".{name}.partial"
    (stage / "sub").mkdir(parents=True)
    (stage / "a.txt").write_text(text)
    (stage / "sub" / "b.txt").write_text(text)
    return stage


def test_publish_flushes_the_whole_stage_before_the_rename(tmp_path, monkeypatch):
    stage = staged(tmp_path, "out", "new")
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst) -> None:
        events.append(("rename", str(src)))
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "rename", rename)
    publish(stage, tmp_path / "out")

    synced_first = {
        p for kind, p in events[: events.index(("rename", str(stage)))] if kind == "fsync"
    }
    expected = {stage / "a.txt", stage / "sub" / "b.txt", stage / "sub", stage}
    assert synced_first == {str(p) for p in expected}
    assert events[-1] == ("fsync", str(tmp_path))  # the rename itself, in the parent's entries
    assert (tmp_path / "out" / "sub" / "b.txt").read_text() == "new"
    assert not stage.exists()


def test_publish_replaces_a_folder_and_removes_what_it_moved_aside(tmp_path):
    final = tmp_path / "out"
    (final / "old_only").mkdir(parents=True)
    aside = aside_name(final)
    (aside / "stale").mkdir(parents=True)  # left by a replacement that crashed
    publish(staged(tmp_path, "out", "new"), final)
    assert sorted(p.name for p in final.iterdir()) == ["a.txt", "sub"]
    assert not aside.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failed_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    stage = staged(tmp_path, "out", "new")
    real_rename = os.rename

    def rename(src, dst) -> None:
        if Path(src) == stage:
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    with pytest.raises(OSError, match="No space"):
        publish(stage, final)
    assert [p.name for p in final.iterdir()] == ["old.txt"]
    assert not aside_name(final).exists()


def test_a_missing_stage_is_refused_before_anything_moves(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    with pytest.raises(FileNotFoundError):
        publish(tmp_path / "never_staged", final)
    assert final.is_dir() and not aside_name(final).exists()


def test_both_checkpoint_writers_publish_through_the_one_helper():
    assert store.publish is publish
    assert checkpointing.publish is publish
