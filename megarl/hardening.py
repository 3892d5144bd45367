"""Rank processes that others cannot read: ``prctl(PR_SET_DUMPABLE, 0)``.

A process of the same user may otherwise read a rank's environment (tokens, keys) and memory
through ``/proc/<pid>/environ`` and ``/proc/<pid>/mem``, or attach a debugger to it. Once a
process is not dumpable, only root (CAP_SYS_PTRACE) may, and it leaves no core dump. Every rank
entry point (megarl.entry, megarl.launch.init_distributed / init_split) and megarl's torchrun
agent call :func:`make_undumpable` first. It holds until the process execs another program.
To attach py-spy or gdb to a rank, run them as root.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def make_undumpable() -> None:
    """Make this process not dumpable (Linux; elsewhere nothing to do)."""
    libc = _libc()
    if libc is not None and libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def is_dumpable() -> bool:
    libc = _libc()
    return libc is None or libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0
