"""Continuous batching at the level of the engine's steps: requests join a :class:`Steps` engine
(vLLM's) between two of its steps, while the requests already running go on.

A driver that batches whole ``generate`` calls (:class:`~megarl.rollout.continuous.CallQueue`, the
agents' :class:`~megarl.agents.generation.EngineGenerator`) makes a request that arrives during a
call wait for the whole call, up to a full turn of the longest response in it. :class:`StepLoop`
owns the engine in one thread: before each step it adds whatever arrived (after ``window_s`` when
the engine was idle, for requests arriving together), runs the step and answers the requests it
finished. Each step is first announced to the engine's other ranks (``share``), which add the same
requests and run the same step (:func:`~megarl.rollout.engine_calls.follow_requests`), so every
rank's scheduler sees the same requests at the same step.

A request keeps its own seed and token limit, so its tokens are drawn as in a ``generate`` call;
as in any batched vLLM call, what shares its steps may move its floats.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from megarl.rollout.engine_calls import (
    DEFAULT_WINDOW_S,
    EngineFailed,
    EngineStep,
    Request,
    Sampled,
    Steps,
    engine_thread_setup,
)
from megarl.rollout.rollout_types import SamplingConfig


class StepLoop:
    """A :class:`Steps` engine's loop (:meth:`run`, in the thread that drives the engine) and
    its door for requests from any thread (:meth:`submit`)."""

    def __init__(
        self,
        engine: Steps,
        sampling: SamplingConfig,
        share: Callable[[EngineStep], object] | None = None,
        *,
        window_s: float = DEFAULT_WINDOW_S,
    ) -> None:
        self.engine = engine
        self.sampling = replace(sampling, n=1)
        self.share = share
        self.window_s = window_s
        self.busy_s = 0.0  # wall seconds inside steps
        self.steps = 0
        self.requests = 0  # requests answered
        self._arrived: list[tuple[str, Request, Future[Sampled]]] = []
        self._running: dict[str, Future[Sampled]] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._failure: EngineFailed | None = None
        self._next_id = 0
        self._thread_setup = engine_thread_setup()  # the creating thread's count, in run's

    def submit(self, request: Request) -> Future[Sampled]:
        """``request``'s turn, once a step has finished it (or the engine's failure)."""
        future: Future[Sampled] = Future()
        with self._changed:
            if self._failure is not None:
                future.set_exception(self._failure)
                return future
            if self._closed:
                raise RuntimeError("the step loop is closed: no request can join it any more")
            self._arrived.append((f"megarl-step-{self._next_id}", request, future))
            self._next_id += 1
            self._changed.notify_all()
        return future

    def close(self) -> None:
        """No request comes any more: :meth:`run` returns once every request is answered."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def run(self) -> None:
        """Step the engine until :meth:`close` and every request answered; a failure (a step's)
        fails every request waiting or running, and any submitted later."""
        try:
            self._thread_setup()
            while self._step():
                pass
        except Exception as e:
            self._fail(e)

    def _step(self) -> bool:
        """One step with whatever arrived; False once closed with nothing left."""
        with self._changed:
            while not (self._arrived or self._running or self._closed):
                self._changed.wait()
            if not (self._arrived or self._running):
                return False
            idle = not self._running
        if idle and self.window_s > 0:  # let the requests arriving together join
            time.sleep(self.window_s)
        with self._changed:
            arrived, self._arrived = self._arrived, []
        step = EngineStep(tuple((key, request) for key, request, _ in arrived))
        self._running.update((key, future) for key, _, future in arrived)
        t0 = time.perf_counter()
        try:
            if self.share is not None:
                self.share(step)
            finished = step.make(self.engine, self.sampling)
        finally:
            self.busy_s += time.perf_counter() - t0
        self.steps += 1
        for key, sampled in finished:
            self._running.pop(key).set_result(sampled)
            self.requests += 1
        return True

    def _fail(self, error: Exception) -> None:
        failure = EngineFailed.of(error)
        with self._changed:
            self._failure = failure
            waiting = [future for _, _, future in self._arrived] + list(self._running.values())
            self._arrived, self._running = [], {}
        for future in waiting:
            future.set_exception(failure)


__all__ = ["StepLoop"]
