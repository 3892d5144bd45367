"""The endpoint's one need of a rollout engine: prompt token ids -> sampled ids, logprobs and why
the turn ended.

:class:`EngineGenerator` puts any engine with the multi-turn loop's ``generate`` seam
(:class:`~megarl.rollout.rollout_types.Generates`: the HF engine, vLLM's) behind it, with the
run's :class:`~megarl.rollout.rollout_types.SamplingConfig`, and batches: the requests that
the endpoint's threads send while the engine is busy (or within ``window_s`` of the call
starting) go to the engine together, in one ``generate`` call, each with its own seed and token
limit. So a trajectory whose tool answered goes on at the engine's next call, whatever the other
trajectories are waiting for (continuous rollout at the level of engine calls).
``max_batch=1`` is one request per call (a lock). An engine with a step loop of its own (vLLM's)
is driven step by step instead (:class:`StepGenerator`): a request joins the running batch at
the engine's next step. :func:`open_generator` picks the one the engine allows.

A request's result does not depend on what shares its call on the HF engine (each request is
generated on its own, unpadded, from its own seeded generator); on vLLM, as in every batched vLLM
call, its floats may (docs/agents.md).

An engine spread over several ranks (vLLM at tensor-parallel 2, say) needs every one of its ranks
in each ``generate`` call, while the endpoint runs on the first rank only: there each call is
first announced to the others (``announce``, a broadcast over the engine's ranks), which make the
same call (:func:`follow_requests`) until the first rank announces the end (None).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Protocol

from megarl.rollout.engine_calls import (
    DEFAULT_WINDOW_S,
    EngineCall,
    EngineFailed,
    EngineMessage,
    Request,
    Sampled,
    Steps,
    engine_thread_setup,
)
from megarl.rollout.rollout_types import Generates, SamplingConfig
from megarl.rollout.step_loop import StepLoop


class Generator(Protocol):
    def sample(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int) -> Sampled:
        """One model turn after ``prompt_ids``: at most ``max_new_tokens`` new tokens drawn from
        the stream ``seed`` names."""
        ...


class OpenGenerator(Generator, Protocol):
    """A :class:`Generator` that drives its engine while its ``with`` block is open."""

    def __enter__(self) -> OpenGenerator: ...

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None: ...


class _Waiting:
    """A request in the queue and, once its call is made, its turn or the call's error."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.result: Sampled | None = None
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class EngineGenerator:
    """:class:`Generator` over a rollout engine, with the run's sampling settings, batching the
    requests of concurrent callers into one engine call (at most ``max_batch`` each; None: no
    limit). ``announce`` hands each call to the engine's other ranks first (None: the engine is
    this rank's).

    No thread of its own: a caller that finds the engine idle makes the next call for everyone
    queued (itself included, or not yet when ``max_batch`` callers are ahead of it), hands out
    the results and leaves the engine to the next caller still waiting."""

    def __init__(
        self,
        engine: Generates,
        sampling: SamplingConfig,
        announce: Callable[[EngineCall], object] | None = None,
        *,
        max_batch: int | None = None,
        window_s: float = DEFAULT_WINDOW_S,
    ) -> None:
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch is {max_batch}; give at least 1 (or None: no limit)")
        self.engine = engine
        self.sampling = replace(sampling, n=1)
        self.announce = announce
        self.max_batch = max_batch
        self.window_s = window_s
        self.calls = 0  # engine calls made
        self.requests = 0  # requests answered (calls / requests: how well they batched)
        self._queue: list[_Waiting] = []
        self._thread_setup = engine_thread_setup()  # callers' threads make calls: the rank's count
        self._busy = False
        self._changed = threading.Condition()

    def sample(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int) -> Sampled:
        mine = _Waiting(Request(list(prompt_ids), max_new_tokens, seed))
        with self._changed:
            self._queue.append(mine)
            self._changed.notify_all()
            while not mine.done:
                if self._busy:
                    self._changed.wait()
                    continue
                self._busy = True
                try:
                    self._changed.release()
                    try:
                        self._make_next_call()
                    finally:
                        self._changed.acquire()
                finally:
                    self._busy = False
                    self._changed.notify_all()
        if mine.error is not None:
            raise EngineFailed(
                f"the rollout engine failed: {type(mine.error).__name__}: {mine.error}"
            ) from mine.error
        assert mine.result is not None
        return mine.result

    def _make_next_call(self) -> None:
        """The engine call for the queue's first ``max_batch`` requests (this caller holds the
        engine, not the lock)."""
        full = self.max_batch is not None and len(self._queue) >= self.max_batch
        if self.window_s > 0 and not full:
            time.sleep(self.window_s)
        with self._changed:
            cut = len(self._queue) if self.max_batch is None else self.max_batch
            batch, self._queue = self._queue[:cut], self._queue[cut:]
        call = EngineCall(tuple(w.request for w in batch))
        self._thread_setup()
        try:
            if self.announce is not None:
                self.announce(call)
            results = call.make(self.engine, self.sampling)
        except Exception as e:  # every request of the call gets the error
            for waiting in batch:
                waiting.error = e
            return
        self.calls += 1
        self.requests += len(batch)
        for waiting, result in zip(batch, results, strict=True):
            waiting.result = result

    def __enter__(self) -> EngineGenerator:
        return self  # the callers drive the engine: nothing to start

    def __exit__(self, *exc: object) -> None:
        return None


class StepGenerator:
    """:class:`Generator` over an engine with a step loop of its own
    (:class:`~megarl.rollout.engine_calls.Steps`): each request joins the running batch at the
    engine's next step (:class:`~megarl.rollout.step_loop.StepLoop`, run by a thread of its own
    while the ``with`` block is open). ``announce`` hands each step to the engine's other ranks
    first."""

    def __init__(
        self,
        engine: Steps,
        sampling: SamplingConfig,
        announce: Callable[[EngineMessage], object] | None = None,
        *,
        window_s: float = DEFAULT_WINDOW_S,
    ) -> None:
        self.loop = StepLoop(engine, sampling, announce, window_s=window_s)
        self._thread = threading.Thread(target=self.loop.run, name="megarl-engine", daemon=True)

    def sample(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int) -> Sampled:
        return self.loop.submit(Request(list(prompt_ids), max_new_tokens, seed)).result()

    def __enter__(self) -> StepGenerator:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.close()
        self._thread.join()


def open_generator(
    engine: Generates,
    sampling: SamplingConfig,
    announce: Callable[[EngineMessage], object] | None = None,
) -> OpenGenerator:
    """Step by step where the engine has a step loop (vLLM), else call by call."""
    if isinstance(engine, Steps):
        return StepGenerator(engine, sampling, announce)
    return EngineGenerator(engine, sampling, announce)


__all__ = ["EngineGenerator", "Generator", "OpenGenerator", "StepGenerator", "open_generator"]
