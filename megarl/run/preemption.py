"""Graceful stops: on SIGTERM or SIGUSR1 (Slurm's ``--signal``, Kubernetes' termination) or
SIGINT (Ctrl-C) every rank finishes its current step, one checkpoint is written, and the run ends
with exit 0 (SIGINT: 130, as an interrupted command does).

The ranks agree at each step boundary with one all-reduce of a flag, so a signal that reaches
only some ranks (or reaches them at different moments) still stops all of them after the same
step. A second signal stops the rank at once.

Under ``megarl train --nproc-per-node N`` the launcher receives the terminal's or the scheduler's
signal and passes it on to every rank as SIGUSR1 (SIGUSR2 for a Ctrl-C; see :mod:`megarl.launch`);
there SIGTERM and SIGINT keep their default meaning for the ranks, since torchrun uses them to end
the ranks.
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


INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C

# The signal that stopped this process's run, if one did (read by the entry point's exit code).
_stopped_by: signal.Signals | None = None


# A user's interruption: Ctrl-C, or the launcher passing one on.
INTERRUPTS = (signal.SIGINT, signal.SIGUSR2)


def graceful_signals() -> tuple[signal.Signals, ...]:
    if os.environ.get(LAUNCHER_ENV):
        return (signal.SIGUSR1, signal.SIGUSR2)
    return (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def stop_exit_code() -> int:
    """This rank's exit code after its run ended: 130 when a Ctrl-C it received itself stopped
    the run, else 0 (under megarl's launcher the ranks exit 0 and the launcher reports 130, so
    that torchrun does not take a clean stop for a failed rank)."""
    return INTERRUPTED_EXIT_CODE if _stopped_by == signal.SIGINT else 0


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
        if not os.environ.get(LAUNCHER_ENV):  # (megarl's launcher has said it for all ranks)
            print(
                f"megarl: rank {self.rank}: {sig.name} received: finishing the current step, "
                "then saving a checkpoint (a second signal stops at once)",
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
        global _stopped_by
        _stopped_by = self.received
        if self.rank == 0:
            what = "interrupted" if self.received in INTERRUPTS else "preempted"
            print(
                f"megarl: {what}: stopped after step {step}; checkpoint {checkpoint}. Run the "
                "same command again to resume from it (trainer.resume=auto).",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
