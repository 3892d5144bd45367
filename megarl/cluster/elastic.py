"""The elastic supervisor: run a job through a launcher and, when a rank dies, restart it by
itself from the latest intact checkpoint on the ranks still available.

One implementation for every launcher (:mod:`megarl.cluster.local`, :mod:`megarl.cluster.ray_job`,
:mod:`megarl.cluster.slurm`). After a failure that a restart can help (a rank killed, a lost node,
a crash, a hang; not a user error, not a preemption or Ctrl-C) the supervisor:

1. leaves the failed rank's slot out of the job from then on (its device or its node's share),
2. waits up to ``trainer.elastic.wait_s`` for lost resources to come back when the launcher can
   grow (a replacement node joining a Ray cluster), then takes what is there,
3. picks the largest world size from there down to ``trainer.elastic.min_world_size`` that some
   layout takes (:mod:`megarl.cluster.layouts`),
4. restarts the job at that layout; its ranks resume from the latest intact checkpoint
   (``trainer.resume=auto``), so data position, RNG streams and LR schedule continue as after a
   normal resume. The steps run after that checkpoint are lost and run again.

Each restart is printed and appended to ``OUTPUT/elastic.jsonl`` (why, old and new layout,
checkpoint, steps lost); the ranks log the attempt's ``elastic/*`` metrics every step.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Hashable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TextIO

from megarl.cluster.job import JobRequest, JobResult, Launcher
from megarl.cluster.layouts import FitCheck, largest_layout, layout_overrides, why_not
from megarl.config import RunConfig
from megarl.files import append_text
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.run.elastic import AttemptRecord
from megarl.run.resume import checkpoint_root
from megarl.run.verification import latest_intact

EVENTS_FILE = "elastic.jsonl"


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint folder ``step_NNNNNNNN``."""
    return int(path.name.removeprefix("step_"))


def last_logged_step(output_dir: Path) -> int:
    """The newest step in the run's metrics.jsonl (0 when none was logged)."""
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line]
    return max(steps, default=0)


@dataclass(frozen=True)
class Restart:
    """One restart decision: why, from which layout to which, from which checkpoint."""

    number: int
    why: str
    old: ParallelLayout
    new: ParallelLayout
    checkpoint: Path | None
    steps_lost: int

    def message(self, max_restarts: int) -> str:
        start = (
            f"from {self.checkpoint.name} (step {checkpoint_step(self.checkpoint)})"
            if self.checkpoint is not None
            else "from the start (no checkpoint yet)"
        )
        return (
            f"megarl: elastic restart {self.number}/{max_restarts}: {self.why}; restarting {start} "
            f"at {self.new} ({self.new.world_size} ranks) instead of {self.old} "
            f"({self.old.world_size} ranks); {self.steps_lost} step(s) since the checkpoint "
            "run again"
        )

    def event(self) -> dict:
        return {
            "restart": self.number,
            "time": time.time(),
            "why": self.why,
            "old_layout": str(self.old),
            "old_world_size": self.old.world_size,
            "new_layout": str(self.new),
            "new_world_size": self.new.world_size,
            "checkpoint": None if self.checkpoint is None else self.checkpoint.name,
            "steps_lost": self.steps_lost,
        }


class Supervisor:
    """Runs ``module_args`` (config + overrides for ``python -m megarl.entry``) at ``layout``
    through ``launcher``, restarting as ``cfg.trainer.elastic`` allows."""

    def __init__(
        self,
        cfg: RunConfig,
        module_args: list[str],
        layout: ParallelLayout,
        launcher: Launcher,
        fits: FitCheck | None = None,
        console: TextIO | None = None,
        extra_ranks: int = 0,
    ) -> None:
        self.cfg, self.module_args, self.initial = cfg, module_args, layout
        self.extra_ranks = extra_ranks  # beyond the layout: an asynchronous run's rollout group
        self.launcher, self.fits = launcher, fits
        self.console = console or sys.stderr
        self.output_dir = Path(cfg.trainer.output_dir)
        self.lost: list[Hashable] = []

    def run(self, module: str = "megarl.entry") -> int:
        e = self.cfg.trainer.elastic
        extra: list[str] = []
        layout, restarts, steps_lost = self.initial, 0, 0
        started = time.time()
        while True:
            record = AttemptRecord(
                restarts, layout.world_size, layout.tp, layout.pp, layout.dp, steps_lost
            )
            env = record.to_env() if e.max_restarts else {}
            args = [*self.module_args, *extra]
            ranks = layout.world_size + self.extra_ranks
            spec = JobRequest(module, args, ranks, env, avoid=tuple(self.lost))
            result = self.launcher.run(spec)
            if not result.restartable or self.launcher.interrupted or not e.max_restarts:
                return result.exit_code
            if restarts >= e.max_restarts:
                self._say(
                    f"megarl: elastic: the job failed again after {restarts} restart(s) "
                    f"(trainer.elastic.max_restarts={e.max_restarts}); giving up"
                )
                return result.exit_code
            restart = self._plan(result, layout, restarts + 1, started)
            if restart is None:
                return result.exit_code
            self._say(restart.message(e.max_restarts))
            self._record(restart)
            restarts, layout, steps_lost = (
                restart.number,
                restart.new,
                steps_lost + restart.steps_lost,
            )
            extra = layout_overrides(layout)
            if restart.checkpoint is not None and self.cfg.trainer.resume != "auto":
                extra.append("trainer.resume=auto")  # this job's own checkpoint

    def _plan(
        self, result: JobResult, layout: ParallelLayout, number: int, started: float
    ) -> Restart | None:
        e = self.cfg.trainer.elastic
        who = f"rank {result.failed_rank}" if result.failed_rank is not None else "a rank"
        why = f"{who} {result.how}" if result.how else f"the job exited with {result.exit_code}"
        if result.slot is not None:
            self.lost.append(result.slot)
        capacity = self._wait_for_capacity(e.wait_s)
        dims = ModelDims.from_pretrained(self.cfg.model.path)
        new = largest_layout(
            self.cfg.parallel,
            dims,
            min(capacity, self.initial.world_size),
            e.min_world_size,
            partial(why_not, self.cfg, dims, fits=self.fits),
            lambda world: self.launcher.placeable(world, self.lost),
        )
        if new is None:
            self._say(
                f"megarl: elastic: {why}; {capacity} rank(s) are left on the {self.launcher.name} "
                f"launcher and no layout of at least trainer.elastic.min_world_size="
                f"{e.min_world_size} ranks fits them; giving up"
            )
            return None
        checkpoint = latest_intact(checkpoint_root(self.cfg.trainer))
        ours = checkpoint is not None and checkpoint.stat().st_mtime >= started
        if self.cfg.trainer.resume != "auto" and not ours:
            checkpoint = None  # resume=never: an older run's checkpoint is not this job's
        done = last_logged_step(self.output_dir)
        base = checkpoint_step(checkpoint) if checkpoint is not None else 0
        return Restart(number, why, layout, new, checkpoint, max(0, done - base))

    def _wait_for_capacity(self, wait_s: float) -> int:
        """Ranks available now; when the launcher can grow, wait up to ``wait_s`` for the job's
        full size to come back."""
        capacity = self.launcher.capacity(self.lost)
        if not self.launcher.can_grow or capacity >= self.initial.world_size:
            return capacity
        self._say(
            f"megarl: elastic: {capacity} of {self.initial.world_size} ranks available; waiting "
            f"up to {wait_s:.0f} s (trainer.elastic.wait_s) for the rest"
        )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and capacity < self.initial.world_size:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            capacity = self.launcher.capacity(self.lost)
        return capacity

    def _record(self, restart: Restart) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        append_text(self.output_dir / EVENTS_FILE, json.dumps(restart.event()) + "\n")

    def _say(self, line: str) -> None:
        print(line, file=self.console, flush=True)
