"""Processes that end with the process that started them: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``.

A rank whose launcher is killed (``kill -9`` of ``megarl train``, an OOM kill, a scheduler's
SIGKILL) would otherwise keep training into the output folder and keep its devices, and a resumed
run would train beside it. The kernel sends the parent-death signal when the parent ends, however
it ends; each launching layer passes it on down: ``megarl train`` -> megarl's torchrun agent ->
the ranks -> their helpers (reward workers; the MLflow writer ends at the end of its input).

A launcher names itself in ``MEGARL_PARENT_PID`` for its children. A child that finds another
parent once the signal is set (its launcher died while it was starting) ends at once, as the
signal would have ended it. A launcher of launchers (megarl's torchrun agent) names itself
again for its own children. Linux only; elsewhere nothing is done.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys

PARENT_ENV = "MEGARL_PARENT_PID"
PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True)  # the interpreter links libc: no library search


def set_parent_death_signal() -> None:
    """SIGKILL this process when its parent ends (Linux; elsewhere nothing)."""
    libc = _libc()
    if libc is not None and libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def end_with_parent() -> None:
    """SIGKILL this process when its parent ends; end now if ``MEGARL_PARENT_PID`` names a
    parent that has already gone. The variable is this process's only: it is removed, so that no
    process further down, started by some other program, checks against the wrong parent."""
    expected = os.environ.pop(PARENT_ENV, None)
    if _libc() is None:
        return
    set_parent_death_signal()
    if expected and expected.isdigit() and os.getppid() != int(expected):
        os.kill(os.getpid(), signal.SIGKILL)  # the launcher died before the signal was set


def children_env() -> dict[str, str]:
    """What a launcher adds to its children's environment: itself as their parent."""
    return {PARENT_ENV: str(os.getpid())}


def parent_death_signal() -> int:
    """This process's parent-death signal (0: none)."""
    libc = _libc()
    if libc is None:
        return 0
    sig = ctypes.c_int(0)
    libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0)
    return sig.value
