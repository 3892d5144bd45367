"""Which checkpoint a run resumes from: the newest one that is intact.

Every file of a training checkpoint is listed in a manifest with its size and checksum (the step
folder's own ``manifest.json`` for ``trainer/``, each role folder's for its model; see
:mod:`megarl.checkpoint.manifest`). Before a resume the ranks check the latest checkpoint against
them, each rank a share of the files (one all-gather of the findings). A damaged checkpoint is
reported naming its files and renamed to ``step_N.damaged`` (kept, never counted by retention nor
deleted), and the next older one is tried; ``latest`` then names the one the run resumes from.

"Intact" means one thing everywhere: :func:`verify_step` finds no problem. :func:`latest_intact`
(one process, nothing changed on disk) is what the elastic supervisor and the pre-launch check
use; :func:`newest_intact` is its collective form at resume, which also sets damaged ones aside.
By default :func:`latest_intact` compares sizes only (cheap on a 70B checkpoint); the ranks'
resume compares checksums too.

Before launch, the CLI runs the cheap part (:func:`precheck_resume`): the checkpoint
:func:`latest_intact` picks, with its trainer state and metadata read the safe way, so a
checkpoint that would run code when loaded is refused before any process starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

import megarl.checkpoint.manifest as manifest
from megarl.checkpoint.contained import link_message, links_under
from megarl.checkpoint.safe_metadata import read_dist_metadata
from megarl.checkpoint.store import MCORE_SUBDIR, step_roles, write_latest
from megarl.errors import CheckpointError
from megarl.run import trainer_state as state_file
from megarl.run.retention import STEP_DIR, checkpoint_steps

DAMAGED_SUFFIX = ".damaged"


def _say(text: str) -> None:
    print(f"megarl: {text}", file=sys.stderr, flush=True)


def candidates(root: Path) -> list[Path]:
    """Checkpoints to try, newest first: the one ``latest`` names and the older visible ones
    (all visible ones when ``latest`` is missing or names no folder)."""
    steps = checkpoint_steps(root)
    newest_first = [steps[s] for s in sorted(steps, reverse=True)]
    pointer = root / "latest"
    if not pointer.is_file():
        return newest_first
    name = pointer.read_text().strip()
    m = STEP_DIR.match(name)
    if m is None or int(m.group(1)) not in steps:
        return newest_first
    return [p for p in newest_first if int(STEP_DIR.match(p.name).group(1)) <= int(m.group(1))]  # type: ignore[union-attr]


def checked_folders(step: Path) -> list[Path]:
    """The folders of a training step that carry a manifest: the step and each role."""
    return [step, *(step / r for r in step_roles(step))]


def _records(step: Path) -> tuple[list[tuple[Path, manifest.FileRecord]], list[str]]:
    """(folder, record) of every file the step's manifests list, largest first; and problems
    found on the way (a manifest that cannot be read)."""
    entries, problems = [], []
    for folder in checked_folders(step):
        try:
            records = manifest.read(folder)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if records is not None:
            entries += [(folder, r) for r in records.values()]
    entries.sort(key=lambda e: (-e[1].bytes, str(e[0]), e[1].path))
    return entries, problems


def unverified(step: Path) -> list[str]:
    """Folders of ``step`` without a manifest (saved by an older megarl)."""
    return [
        str(f.relative_to(step)) or "." for f in checked_folders(step) if manifest.read(f) is None
    ]


def verify_step(step: Path, *, full: bool = True) -> list[str]:
    """Problems of a training checkpoint (paths relative to ``step``), empty when intact.

    Collective when torch.distributed is initialised: rank r checks every world-th file of the
    manifests (largest first, so the work spreads evenly), and all ranks get all findings.
    """

    entries, problems = _records(step)
    if step.is_symlink():  # a step folder linked in from elsewhere is not this run's
        problems.append(link_message(step.parent, step.name))
    else:
        problems += [link_message(step, rel) for rel in links_under(step)]
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if multi else (0, 1)
    check = manifest.problem if full else manifest.size_problem
    mine = []
    for i, (folder, record) in enumerate(entries):
        if i % world == rank and (found := check(folder, record)) is not None:
            where = folder.relative_to(step).as_posix()
            mine.append(found if where == "." else f"{where}/{found}")
    if multi:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        mine = [p for part in everyone for p in part]
    return problems + sorted(mine)


def set_aside(step: Path) -> Path:
    """Rename a damaged checkpoint to ``step_N.damaged`` (``-2``, ... if taken)."""
    target, n = step.with_name(step.name + DAMAGED_SUFFIX), 1
    while target.exists():
        n += 1
        target = step.with_name(f"{step.name}{DAMAGED_SUFFIX}-{n}")
    os.rename(step, target)
    return target


def _summary(problems: list[str], limit: int = 3) -> str:
    more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def newest_intact(root: Path, rank: int) -> Path | None:
    """The newest intact checkpoint of ``root`` (None: there is none to resume from); damaged
    newer ones are set aside on the way (by rank 0). Collective."""

    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    tried = candidates(root)
    damaged: list[str] = []
    for step in tried:
        problems = verify_step(step)
        if not problems:
            if damaged and rank == 0:
                write_latest(root, step.name)
                _say(f"resuming from {step.name}, the newest intact checkpoint")
            missing = unverified(step)
            if missing and rank == 0:
                _say(
                    f"{step} has no manifest in {', '.join(missing)} (saved by an older megarl): "
                    "its files are not verified"
                )
            if multi:
                dist.barrier()  # rank 0's renames and `latest` are visible to all
            return step
        damaged.append(f"{step.name}: {_summary(problems)}")
        if rank == 0:
            moved = set_aside(step)
            _say(
                f"checkpoint {step} is damaged: {_summary(problems)}. Kept as {moved.name}; "
                "trying the next older checkpoint"
            )
    if multi:
        dist.barrier()
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint to resume from in {root}: {' | '.join(damaged)}. The damaged "
            f"ones were kept as step_N{DAMAGED_SUFFIX}. Restore them from a copy, or set "
            "trainer.overwrite=true to move this run aside and start afresh"
        )
    return None


def latest_intact(root: Path, *, checksums: bool = False) -> Path | None:
    """The newest checkpoint under ``root`` whose files match their manifests (sizes; with
    ``checksums`` their checksums too), or None. One process; nothing on disk is changed. A
    checkpoint without manifests (an older megarl's) counts as intact."""
    for step in candidates(root):
        try:
            problems = verify_step(step, full=checksums)
        except CheckpointError:
            continue
        if not problems:
            return step
    return None


def precheck_resume(root: Path) -> Path | None:
    """Before launch (no process group): the checkpoint a resume would most likely use
    (:func:`latest_intact`), with its trainer state and every role's dist-checkpoint metadata
    read the safe way; a CheckpointError for one that holds code."""
    step = latest_intact(root)
    if step is None:
        return None
    state_file.read(step)
    for role in step_roles(step):
        read_dist_metadata(step / role / MCORE_SUBDIR)
    return step
