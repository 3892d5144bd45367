"""A per-rank hang watchdog: a step phase without progress for ``trainer.hang_timeout_s`` makes
the rank print where it is (the phase, the step, Python stacks of all threads) and exit non-zero.

The loop marks its phases (rollout, reward, update, save ...) with :func:`phase`; a daemon thread
checks the time since the last mark. In a hang every rank stops making progress (the stuck one,
and the others waiting for it in a collective), so every rank reports; the launcher then ends the
job. One watchdog per process, like the signal handlers and faulthandler it stands beside.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

HANG_EXIT_CODE = 3


def collective_timeout_s(hang_timeout_s: float) -> float:
    """torch.distributed's collective timeout: a little longer than the watchdog's, so that the
    watchdog reports first (with stacks) and the collective timeout is the backstop."""
    return hang_timeout_s + max(60.0, 0.25 * hang_timeout_s)


class Watchdog:
    def __init__(self, timeout_s: float, rank: int) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.rank = timeout_s, rank
        self.phase, self.step = "start", -1
        self.since = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megarl-watchdog", daemon=True)

    def mark(self, phase: str, step: int | None = None) -> None:
        self.phase, self.since = phase, time.monotonic()
        if step is not None:
            self.step = step

    @property
    def _interval(self) -> float:
        return min(5.0, self.timeout_s / 10)

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            idle = time.monotonic() - self.since
            if idle > self.timeout_s:
                self._report(idle)

    def _report(self, idle: float) -> None:
        where = f"phase '{self.phase}' of step {self.step + 1}"
        print(
            f"megarl: rank {self.rank}: no progress for {idle:.0f} s in {where} "
            f"(trainer.hang_timeout_s={self.timeout_s:g}); Python stacks of all threads:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print(
            f"megarl: error: rank {self.rank} hung in {where}; stopping the job. A rank stuck in "
            "a collective or a rollout is the usual cause; raise trainer.hang_timeout_s if this "
            "phase legitimately takes longer. Resume from the last checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        # The other ranks' watchdogs fire within about one check interval: give them time to
        # report before this exit makes the launcher end them.
        time.sleep(2 * self._interval + 1.0)
        os._exit(HANG_EXIT_CODE)  # the main thread is stuck: only a hard exit ends the process

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()


_current: Watchdog | None = None


def start(timeout_s: float, rank: int) -> Watchdog:
    """Start this process's watchdog (replacing an earlier one)."""
    global _current
    if _current is not None:
        _current.close()
    _current = Watchdog(timeout_s, rank).start()
    return _current


def stop() -> None:
    global _current
    if _current is not None:
        _current.close()
        _current = None


def beat(name: str, step: int | None = None) -> None:
    """Progress: ``name`` (of ``step``) is now running; no-op without a started watchdog."""
    if _current is not None:
        _current.mark(name, step)


@contextmanager
def phase(name: str, step: int | None = None) -> Iterator[None]:
    """Mark ``name`` (of ``step``) as the running phase; no-op without a started watchdog."""
    dog = _current
    if dog is None:
        yield
        return
    previous = dog.phase
    dog.mark(name, step)
    try:
        yield
    finally:
        dog.mark(previous)  # the end of a phase is progress too
