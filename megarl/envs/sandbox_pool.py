"""Sandboxes started before the calls that take them: a call then pays for running its program,
not for making its sandbox (bwrap's set-up and the interpreter's start-up, ~40-60 ms here).

One pool per (boundary, view, limits) in a process, shared by every python tool with those
settings (a run makes one ToolEnvironment per sample). Taking a sandbox starts its replacement
at once, from the taking thread, so the new one gets ready while the taken one runs. A sandbox
that died waiting (its parent thread ended: bwrap's --die-with-parent) is dropped and replaced.
The ready ones are ended at the process's exit; a forked child forgets its parent's.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections import deque

from megarl.envs.boundary import Boundary
from megarl.envs.interpreter_view import InterpreterView
from megarl.envs.sandbox_limits import SandboxLimits
from megarl.envs.sandbox_process import SandboxProcess


class ReadySandboxes:
    def __init__(
        self, boundary: Boundary, view: InterpreterView, limits: SandboxLimits, size: int
    ) -> None:
        if size < 1:
            raise ValueError(f"a pool of ready sandboxes needs size >= 1, got {size}")
        self.boundary, self.view, self.limits, self.size = boundary, view, limits, size
        self._ready: deque[SandboxProcess] = deque()
        self._lock = threading.Lock()
        self._owner = os.getpid()

    def _start(self) -> SandboxProcess:
        return SandboxProcess(self.boundary, self.view, self.limits).start()

    def take(self) -> SandboxProcess:
        """A started sandbox (a fresh one when none is ready); the pool refills itself."""
        taken = None
        with self._lock:
            while self._ready and taken is None:
                candidate = self._ready.popleft()
                if candidate.alive:
                    taken = candidate
                else:
                    candidate.close()
        if taken is None:
            taken = self._start()
        self.refill()
        return taken

    def refill(self) -> None:
        while True:
            with self._lock:
                if len(self._ready) >= self.size:
                    return
            started = self._start()
            with self._lock:
                self._ready.append(started)

    def close(self) -> None:
        if os.getpid() != self._owner:
            return
        with self._lock:
            waiting, self._ready = list(self._ready), deque()
        for sandbox in waiting:
            sandbox.close()


_POOLS: dict[tuple[str, InterpreterView, SandboxLimits, int], ReadySandboxes] = {}
_POOLS_LOCK = threading.Lock()


def ready_sandboxes(
    boundary: Boundary, view: InterpreterView, limits: SandboxLimits, size: int
) -> ReadySandboxes:
    """This process's pool for these settings (made on first use)."""
    key = (boundary.name, view, limits, size)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ReadySandboxes(boundary, view, limits, size)
    return pool


def close_all() -> None:
    """End every ready sandbox of this process (at exit; tests and benches may call it)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


def _forget_in_child() -> None:
    _POOLS.clear()  # the parent's sandboxes are the parent's to end


atexit.register(close_all)
os.register_at_fork(after_in_child=_forget_in_child)
