"""Graceful preemption: on SIGTERM or SIGUSR1 (Slurm's ``--signal``, Kubernetes' termination)
every rank finishes its current step, one checkpoint is written, and the run ends with exit 0.

The ranks agree at each step boundary with one all-reduce of a flag, so a signal that reaches
only some ranks (or reaches them at different moments) still stops all of them after the same
step. A second signal stops the rank at once.

Under ``megarl train --nproc-per-node N`` the launcher receives the scheduler's signal and passes
it on to every rank as SIGUSR1 (see :mod:`megarl.launch`); there SIGTERM keeps its default
meaning for the ranks, since torchrun sends it to end them when another rank has failed.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

import torch
import torch.distributed as dist

from megarl import platform

LAUNCHER_ENV = "MEGARL_LAUNCHER_PID"


def graceful_signals() -> tuple[signal.Signals, ...]:
    if os.environ.get(LAUNCHER_ENV):
        return (signal.SIGUSR1,)
    return (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Installs the handlers on creation (main thread); :meth:`close` puts the old ones back."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.received: signal.Signals | None = None
        self._old = {s: signal.signal(s, self._handle) for s in graceful_signals()}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            print(f"megarl: rank {self.rank}: second {sig.name}: stopping now", file=sys.stderr)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = sig
        print(
            f"megarl: rank {self.rank}: {sig.name} received: finishing the current step, then "
            "saving a checkpoint (a second signal stops at once)",
            file=sys.stderr,
            flush=True,
        )

    def requested(self) -> bool:
        """Whether any rank got a signal; collective (call at the same point on every rank)."""
        flag = torch.tensor(
            [0.0 if self.received is None else 1.0], device=platform.collective_device()
        )
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0

    def report(self, step: int, checkpoint: str) -> None:
        if self.rank == 0:
            print(
                f"megarl: preempted: stopped after step {step}; checkpoint {checkpoint}. Run the "
                "same command again to resume from it (trainer.resume=auto).",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
