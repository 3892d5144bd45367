"""Which training checkpoints to keep: the newest ``keep_last``, plus every ``keep_every``-th step.

Called by rank 0 right after a checkpoint is complete and ``latest`` points to it, so only older
complete checkpoints are ever removed, never the newest (being written or just written) nor the
one ``latest`` names (the one a resume reads). A folder is first renamed to a hidden name and then
deleted, so a crash mid-removal leaves no damaged checkpoint under a visible name.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{8,})$")
HIDDEN_LEFTOVER = re.compile(r"^\.step_\d{8,}\.(partial|replaced|removing)$")


def checkpoint_steps(root: Path) -> dict[int, Path]:
    """Complete training checkpoints under ``root`` by step (visible ``step_N`` folders; a link
    named so is not one: it is never resumed from nor removed)."""
    out = {}
    for p in root.iterdir() if root.is_dir() else []:
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and not p.is_symlink():
            out[int(m.group(1))] = p
    return out


def to_remove(steps: list[int], *, keep_last: int, keep_every: int, protect: set[int]) -> list[int]:
    """The steps to delete (pure): all but the newest ``keep_last``, multiples of ``keep_every``
    (when > 0) and ``protect``."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    newest = set(sorted(steps)[-keep_last:])
    kept = newest | protect | {s for s in steps if keep_every > 0 and s % keep_every == 0}
    return sorted(s for s in steps if s not in kept)


def _latest_step(root: Path) -> int | None:
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    m = STEP_DIR.match(pointer.read_text().strip())
    return int(m.group(1)) if m else None


def prune(root: Path, *, keep_last: int, keep_every: int = 0) -> list[Path]:
    """Remove old checkpoints of ``root``; returns the removed folders. Rank 0 only.

    Nothing is removed unless ``latest`` names a complete checkpoint; it and every newer
    checkpoint are kept whatever the settings.
    """
    current = _latest_step(root)
    steps = checkpoint_steps(root)
    if current is None or current not in steps:
        return []
    protect = {s for s in steps if s >= current}
    removed = []
    for step in to_remove(list(steps), keep_last=keep_last, keep_every=keep_every, protect=protect):
        folder = steps[step]
        hidden = root / f".{folder.name}.removing"
        shutil.rmtree(hidden, ignore_errors=True)
        os.rename(folder, hidden)
        shutil.rmtree(hidden, ignore_errors=True)
        removed.append(folder)
    return removed


def remove_stale_partials(root: Path) -> None:
    """Remove hidden leftovers of saves or removals a crash interrupted (rank 0, before a save)."""
    for p in root.iterdir():
        if HIDDEN_LEFTOVER.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
