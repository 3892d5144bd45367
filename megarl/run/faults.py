"""Test-only fault injection, driven by the ``MEGARL_FAULT`` environment variable.

Never set it in a real run. The fault tests use it to fail at an exact point instead of relying
on timing: ``MEGARL_FAULT="ACTION@POINT[:rank=R][:step=S]"``, several separated by ``,``; steps
count from 1, as logged.

Points: ``step`` (start of a step), ``sync`` (before the step-boundary agreement, a collective),
``save`` (a checkpoint save, after the models are written, before the trainer state).
Actions: ``kill`` (SIGKILL this rank), ``enospc`` (raise "No space left on device"),
``sigterm`` (send the preemption signal to the ``megarl train`` launcher, or this process),
``sigint`` (the same with SIGINT, as a Ctrl-C in the terminal sends it),
``sleep`` (sleep for an hour).
"""

from __future__ import annotations

import errno
import os
import signal
import time

import torch.distributed as dist

ENV = "MEGARL_FAULT"


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _enospc() -> None:
    raise OSError(errno.ENOSPC, "No space left on device (injected by MEGARL_FAULT)")


def _sigterm() -> None:
    os.kill(int(os.environ.get("MEGARL_LAUNCHER_PID", os.getpid())), signal.SIGTERM)


def _sigint() -> None:
    """A Ctrl-C: SIGINT to the ``megarl train`` launcher (or this process)."""
    os.kill(int(os.environ.get("MEGARL_LAUNCHER_PID", os.getpid())), signal.SIGINT)


def _sleep() -> None:
    time.sleep(3600)


ACTIONS = {
    "kill": _kill,
    "enospc": _enospc,
    "sigterm": _sigterm,
    "sigint": _sigint,
    "sleep": _sleep,
}


def parse(spec: str) -> list[tuple[str, str, dict[str, int]]]:
    """``"kill@save:rank=1:step=2"`` -> ``[("kill", "save", {"rank": 1, "step": 2})]``."""
    out = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        head, *opts = entry.split(":")
        action, _, point = head.partition("@")
        if action not in ACTIONS or not point:
            raise ValueError(f"{ENV}: bad entry {entry!r}; see megarl/run/faults.py")
        out.append((action, point, {k: int(v) for k, v in (o.split("=", 1) for o in opts)}))
    return out


def inject(point: str, step: int) -> None:
    """Run the faults ``MEGARL_FAULT`` names for ``point`` at ``step`` on this rank (test-only)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    for action, at, opts in parse(spec):
        if at == point and opts.get("step", step) == step and opts.get("rank", rank) == rank:
            ACTIONS[action]()
