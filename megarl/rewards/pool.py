"""A small pool of scorer processes that survives slow, hung and crashing scorers.

Each worker runs one task at a time, so the parent knows which task runs where and since when.
A task past its soft timeout is interrupted inside the worker (SIGALRM); one that ignores it
(stuck in C code) is killed `grace_s` later and its worker replaced; a worker that dies fails only
its own task. multiprocessing.Pool and ProcessPoolExecutor offer neither per-task kill nor
per-task start times, hence this.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from megarl.parent_death import end_with_parent
from megarl.rewards.scoring import ScoreOutcome, ScoreTask, resolve_scorer, run_task

BEGUN = "begun"  # a worker's word that its scorer is loaded and the task's time starts now
START_LIMIT_S = 120.0  # a worker that has not begun its task by then (stuck importing) is killed


def _worker_main(conn: Connection, timeout_s: float | None) -> None:
    end_with_parent()  # a scorer stuck in a task ends with its rank, however the rank ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        # the scorer's module is imported before the clock starts: a fresh worker's first import
        # (the scorer's own dependencies) is not the scorer's run time
        with contextlib.suppress(Exception):  # an import that fails is run_task's to report
            resolve_scorer(task.fn)
        conn.send(BEGUN)
        conn.send(run_task(task, timeout_s))


class _Worker:
    def __init__(self, ctx: Any, timeout_s: float | None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, timeout_s), daemon=True)
        self.proc.start()
        child.close()
        self.task: ScoreTask | None = None
        self.sent = 0.0
        self.started: float | None = None  # when the worker began the task (BEGUN)

    def stop(self, timeout: float = 1.0) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class ScorerPool:
    """`num_workers` scorer processes, started on first use and kept for later batches."""

    def __init__(
        self,
        num_workers: int,
        *,
        timeout_s: float | None,
        grace_s: float = 2.0,
        mp_context: str = "spawn",
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self._ctx = mp.get_context(mp_context)
        self._workers: list[_Worker] = []
        self.restarts = 0

    def _replace(self, w: _Worker) -> _Worker:
        i = self._workers.index(w)
        self._workers[i] = _Worker(self._ctx, self.timeout_s)
        self.restarts += 1
        return self._workers[i]

    @staticmethod
    def _deadline(w: _Worker, hard_limit: float) -> float:
        """The task's time counts from BEGUN: a fresh worker's start-up (spawn, imports) is not
        the scorer's, and on a busy machine it can take longer than a tight timeout."""
        if w.started is None:
            return w.sent + START_LIMIT_S
        return w.started + hard_limit

    def run(self, tasks: Sequence[ScoreTask]) -> list[ScoreOutcome]:
        """Outcomes in task order; every task gets one, whatever its scorer or worker did."""
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.timeout_s))
        todo = deque(tasks)
        done: dict[int, ScoreOutcome] = {}
        hard_limit = None if self.timeout_s is None else self.timeout_s + self.grace_s
        while todo or any(w.task for w in self._workers):
            for w in list(self._workers):
                if w.task is None and todo:
                    task = todo.popleft()
                    try:
                        w.conn.send(task)
                    except OSError:  # the worker died while idle
                        todo.appendleft(task)
                        self._replace(w).task = None
                        continue
                    w.task, w.sent, w.started = task, time.monotonic(), None
            busy = [w for w in self._workers if w.task is not None]
            if not busy:
                continue
            wait_s = None
            if hard_limit is not None:
                wait_s = max(
                    0.0, min(self._deadline(w, hard_limit) for w in busy) - time.monotonic()
                )
            wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], wait_s)
            now = time.monotonic()
            for w in busy:
                assert w.task is not None
                index = w.task.index
                if w.conn.poll():
                    try:
                        message = w.conn.recv()
                    except (EOFError, OSError):
                        message = None  # the worker died: its liveness check below reports it
                    if message == BEGUN:
                        w.started = time.monotonic()
                        continue
                    if message is not None:
                        done[index] = message
                        w.task = None
                        continue
                if not w.proc.is_alive():
                    code = w.proc.exitcode
                    done[index] = ScoreOutcome(
                        index, "error", 0.0, f"scorer worker process died (exit code {code})"
                    )
                    w.kill()
                    self._replace(w)
                elif hard_limit is not None and now >= self._deadline(w, hard_limit):
                    message = (
                        f"scorer ran past {self.timeout_s} s and was killed"
                        if w.started is not None
                        else f"scorer worker did not start the task within {START_LIMIT_S:.0f} s"
                    )
                    done[index] = ScoreOutcome(index, "timeout", 0.0, message)
                    w.kill()
                    self._replace(w)
        return [done[t.index] for t in tasks]

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []
