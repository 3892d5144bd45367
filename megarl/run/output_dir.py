"""Output folders are protected: a run never writes over an earlier run without being told to.

A run that would start afresh (``trainer.resume=never``, or ``auto`` with nothing to resume from)
in a ``trainer.output_dir`` that holds checkpoints or logged metrics stops before launch, naming
the folder and the two ways on: ``trainer.resume=auto`` (continue it) or ``trainer.overwrite=true``
(which renames the earlier run's folder to ``OUT.old-<time>`` and starts in an empty one; nothing
is deleted). The CLI decides before any process starts; the ranks decide again (a job started by
``srun`` or torchrun directly has no CLI step), and there rank 0 does the move. An elastic
restart's ranks (:mod:`megarl.cluster.elastic`) skip the check: the folder is their own job's.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megarl.config import TrainerConfig
from megarl.errors import ConfigError
from megarl.files import replace_file
from megarl.run.elastic import AttemptRecord
from megarl.run.retention import checkpoint_steps

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class EarlierRun:
    """What an output folder holds of an earlier run."""

    folder: Path
    steps: tuple[int, ...]  # checkpoint steps (visible step_N folders)
    has_latest: bool
    metrics: bool  # a non-empty metrics.jsonl

    @property
    def exists(self) -> bool:
        return bool(self.steps or self.has_latest or self.metrics)

    @property
    def resumable(self) -> bool:
        return bool(self.steps or self.has_latest)

    def describe(self) -> str:
        parts = []
        if self.steps:
            shown = ", ".join(f"step {s}" for s in self.steps[-3:])
            parts.append(f"checkpoints ({shown})")
        elif self.has_latest:
            parts.append("a checkpoints/latest file")
        if self.metrics:
            parts.append(f"logged metrics ({METRICS_FILE})")
        return " and ".join(parts)


def earlier_run(folder: str | Path) -> EarlierRun:
    folder = Path(folder)
    root = folder / CHECKPOINTS
    metrics = folder / METRICS_FILE
    return EarlierRun(
        folder=folder,
        steps=tuple(sorted(checkpoint_steps(root))),
        has_latest=(root / "latest").is_file(),
        metrics=metrics.is_file() and metrics.stat().st_size > 0,
    )


def check_output_dir(t: TrainerConfig) -> bool:
    """Refuse a fresh start over an earlier run (ConfigError naming the ways on); True when
    ``trainer.overwrite`` asks for the earlier run to be moved aside (:func:`move_aside`)."""
    found = earlier_run(t.output_dir)
    if not found.exists:
        return False
    if t.overwrite:
        return True
    if t.resume == "never":
        raise ConfigError(
            f"trainer.output_dir={found.folder} holds an earlier run ({found.describe()}), and "
            "trainer.resume=never would start afresh over it (overwriting its checkpoints and "
            "appending to its metrics). Set trainer.resume=auto to continue it, or "
            "trainer.overwrite=true to move it aside (to a sibling folder; nothing is deleted), "
            "or choose another trainer.output_dir"
        )
    if not found.resumable:
        raise ConfigError(
            f"trainer.output_dir={found.folder} holds {found.describe()} of an earlier run but "
            "no checkpoint to continue from, so this run would start afresh and mix its metrics "
            "with the earlier ones. Set trainer.overwrite=true to move the earlier run aside (to "
            "a sibling folder; nothing is deleted), or choose another trainer.output_dir"
        )
    return False


def aside_name(folder: Path, now: float | None = None) -> Path:
    """``OUT.old-YYYYmmdd-HHMMSS`` beside ``folder`` (with a counter if that exists)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = folder.with_name(f"{folder.name}.old-{stamp}")
    target, n = base, 1
    while target.exists():
        n += 1
        target = base.with_name(f"{base.name}-{n}")
    return target


def move_aside(folder: str | Path) -> Path:
    """Rename ``folder`` (an earlier run) to a sibling :func:`aside_name`; returns the new path."""
    folder = Path(folder).absolute()
    target = aside_name(folder)
    try:
        os.rename(folder, target)
    except OSError as e:
        raise ConfigError(
            f"trainer.overwrite=true: cannot move the earlier run in {folder} to {target} ({e}); "
            "move or remove it yourself, or choose another trainer.output_dir"
        ) from None
    print(
        f"megarl: trainer.overwrite=true: moved the earlier run in {folder} to {target} "
        "(nothing was deleted)",
        file=sys.stderr,
        flush=True,
    )
    return target


def restart_metrics(path: Path) -> None:
    """An elastic restart from the start (no checkpoint yet) logs every step again: the failed
    attempt's lines of ``path`` go (atomically), so each step is in it once."""
    if path.is_file() and path.stat().st_size:
        replace_file(path, "")


def prepare_output_dir(trainer: TrainerConfig, rank: int) -> None:
    """On every rank of a job, before any model is built: the check of :func:`check_output_dir`,
    then rank 0 moves the earlier run aside when asked; collective."""
    import torch.distributed as dist

    record = AttemptRecord.from_env()
    if record is not None and record.restarts > 0:  # an elastic restart: the folder is its job's
        if rank == 0 and not earlier_run(trainer.output_dir).resumable:
            restart_metrics(Path(trainer.output_dir) / METRICS_FILE)
        return
    move = check_output_dir(trainer)  # every rank sees the same folder: the same answer everywhere
    if not move:
        return
    dist.barrier()  # every rank has looked before rank 0 renames
    failed: list[str | None] = [None]
    if rank == 0:
        try:
            move_aside(trainer.output_dir)
        except ConfigError as e:
            failed[0] = str(e)
    dist.broadcast_object_list(failed, src=0)
    if failed[0] is not None:
        raise ConfigError(failed[0])
