"""What keeps a long run safe on a cluster, as the loop sees it: graceful preemption at step
boundaries, the hang watchdog over the step phases, and the test-only fault points."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from megarl.run import faults, watchdog
from megarl.run.preemption import Preemption


class RunGuards:
    """Created before the run is set up (a signal during set-up is honoured at the first step
    boundary); :meth:`start` once the process group exists; :meth:`close` at the end."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.preemption = Preemption(self.rank)

    def start(self, hang_timeout_s: float) -> None:
        watchdog.start(hang_timeout_s, self.rank)

    def begin_step(self, step: int) -> None:
        watchdog.beat("step", step)
        faults.inject("step", step + 1)  # fault specs count steps from 1, as logged

    def should_stop(self, step: int) -> bool:
        """Whether any rank was asked to stop; collective, at the end of every step."""
        with watchdog.phase("sync", step):
            faults.inject("sync", step + 1)
            return self.preemption.requested()

    def report_stop(self, step: int, checkpoint: str) -> None:
        self.preemption.report(step, checkpoint)

    def end_step(self, step: int, save_due: bool, save: Callable[[int], Path]) -> bool:
        """At the end of step ``step`` (0-based) on every rank: checkpoint when ``save_due`` or
        when a stop was asked for (``save(step + 1)``); True when the run must stop now."""
        stop = self.should_stop(step)  # SIGTERM / SIGUSR1 / SIGINT on any rank
        saved = save(step + 1) if save_due or stop else None
        if stop:
            self.report_stop(step + 1, str(saved))
        return stop

    def close(self) -> None:
        watchdog.stop()
        self.preemption.close()
