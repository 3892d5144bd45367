"""Stage-then-rename: a folder appears under its final name only once all of it is on disk.

Writers fill a hidden sibling folder (the stage) and call :func:`publish`, which flushes every
file and folder of the stage to disk, moves a folder already at the final name aside, renames the
stage into place and flushes the parent folder, so that neither a crash nor a power loss leaves
a half-written folder under the final name. Checkpoints of one model
(:func:`megarl.checkpoint.store.staged_output`) and of a training step
(:mod:`megarl.run.checkpointing`) both publish this way.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def aside_name(final: Path) -> Path:
    """Where :func:`publish` moves the folder it replaces (hidden, beside ``final``)."""
    return final.with_name(f".{final.name}.replaced")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(folder: Path) -> None:
    """Flush every file below ``folder`` to disk, then each folder's entries (deepest first)."""

    def fail(error: OSError) -> None:
        raise error

    for parent, _, files in os.walk(folder, topdown=False, onerror=fail):
        for name in files:
            _fsync(Path(parent, name))
        _fsync(Path(parent))


def publish(stage: Path, final: Path) -> None:
    """Rename the finished ``stage`` to ``final`` (same parent folder), replacing what is there.

    A folder at ``final`` is first moved to :func:`aside_name` and removed once the stage is in
    place: at every moment ``final`` holds the old folder, the new one, or (for the instant
    between two renames) nothing, never a mix. Raises :class:`OSError` as the file system does;
    when the stage cannot be renamed, the old folder is put back first.
    """
    sync_tree(stage)
    aside = aside_name(final)
    replacing = final.exists()
    if replacing:
        shutil.rmtree(aside, ignore_errors=True)  # a crashed earlier replacement's
        os.rename(final, aside)
    try:
        os.rename(stage, final)
    except OSError:
        if replacing:
            os.rename(aside, final)
        raise
    _fsync(final.parent)
    if replacing:
        shutil.rmtree(aside, ignore_errors=True)
