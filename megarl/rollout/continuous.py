"""The continuous turn loop (``rollout.environment.turn_loop=continuous``): each trajectory goes on as soon as
its own environment answers, instead of waiting for the slowest environment of the turn.

The first model turn is the lock-step loop's (:func:`~megarl.rollout.multi_turn.model_turn`: every
sample starts together, so one call, the single-turn request where the prompts allow). From then
on, on the executing rank, every trajectory is a coroutine on the environments' event loop: its
environment steps (in the tool pool), and its next turn's request joins a :class:`TurnQueue`:
- on an engine with a step loop of its own (vLLM's, :class:`~megarl.rollout.engine_calls.Steps`),
  :class:`StepQueue`: the request joins the running batch at the engine's next step
  (:class:`~megarl.rollout.step_loop.StepLoop`);
- on any other engine (the HF engine), :class:`CallQueue`: the engine is sent whatever is queued
  each time it is free, in one ``generate`` call.
The engine's other ranks make the same calls or steps
(:func:`~megarl.rollout.engine_calls.follow_requests`).

Each request keeps its lock-step seed and token budget (:func:`~megarl.rollout.multi_turn.turn_seed`,
:func:`~megarl.rollout.multi_turn.turn_budget`), so on an engine that generates each request on
its own (the HF engine) the trajectories equal the lock-step loop's token for token; on vLLM a
call's other requests may move the floats, as in any batched call, so a run is not repeatable bit
for bit (``rollout.environment.turn_loop=lockstep`` is).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

from megarl.envs.runner import EnvRunner, Started
from megarl.envs.trajectory import Trajectory
from megarl.rollout.engine_calls import (
    DEFAULT_WINDOW_S,
    EngineCall,
    EngineFailed,
    Request,
    Sampled,
    Steps,
    engine_thread_setup,
    follow_requests,
)
from megarl.rollout.multi_turn import (
    TurnLimits,
    answer_of,
    model_turn,
    open_next,
    start_trajectories,
    take_answer,
    turn_budget,
    turn_seed,
)
from megarl.rollout.rollout_split import SampleStart
from megarl.rollout.rollout_types import Generates, SamplingConfig
from megarl.rollout.step_loop import StepLoop
from megarl.rollout.trajectory_source import Share


class TurnQueue(Protocol):
    """Where the trajectories' turns wait for the engine, on one event loop."""

    @property
    def busy_s(self) -> float:
        """Wall seconds the engine was working on the queue's requests."""
        ...

    async def sample(self, request: Request) -> Sampled:
        """``request``'s turn, once the engine has made it."""
        ...

    async def serve(self) -> None:
        """Drive the engine until :meth:`close` and every request answered."""
        ...

    def close(self) -> None: ...


@dataclass
class CallQueue:
    """Requests of the trajectories that are ready, sent to the engine together each time it is
    free (after ``window_s``, for requests arriving with the first); ``share`` announces each call
    to the engine's other ranks first. Lives on one event loop; the engine runs in a thread of
    its own, so the loop (the environments) goes on during a call."""

    engine: Generates
    sampling: SamplingConfig
    share: Share
    window_s: float = DEFAULT_WINDOW_S
    busy_s: float = 0.0  # wall seconds inside engine calls
    _queue: list[tuple[Request, asyncio.Future[Sampled]]] = field(default_factory=list)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _closed: bool = False
    _thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            1, thread_name_prefix="megarl-engine", initializer=engine_thread_setup()
        )
    )

    async def sample(self, request: Request) -> Sampled:
        """``request``'s turn, once a call has made it."""
        future: asyncio.Future[Sampled] = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        self._ready.set()
        return await future

    def close(self) -> None:
        """No request comes any more: :meth:`serve` returns once the queue is empty."""
        self._closed = True
        self._ready.set()

    def _make(self, call: EngineCall) -> list[Sampled]:
        self.share(call)
        return call.make(self.engine, replace(self.sampling, n=1))

    async def serve(self) -> None:
        """Make calls until :meth:`close`; a failed call fails its requests (every one)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                if not self._queue:
                    if self._closed:
                        return
                    continue
                if self.window_s > 0:
                    await asyncio.sleep(self.window_s)
                batch, self._queue = self._queue, []
                call = EngineCall(tuple(request for request, _ in batch))
                t0 = time.perf_counter()
                try:
                    results = await loop.run_in_executor(self._thread, self._make, call)
                except Exception as e:
                    failed = EngineFailed.of(e)
                    for _, future in batch:
                        future.set_exception(failed)
                    continue
                finally:
                    self.busy_s += time.perf_counter() - t0
                for (_, future), result in zip(batch, results, strict=True):
                    future.set_result(result)
        finally:
            self._thread.shutdown(wait=False)


class StepQueue:
    """A :class:`~megarl.rollout.step_loop.StepLoop` seen from the event loop: requests join the
    engine's running batch at its next step; the loop runs in a thread of its own."""

    def __init__(self, engine: Steps, sampling: SamplingConfig, share: Share) -> None:
        self.steps = StepLoop(engine, sampling, share)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="megarl-engine")

    @property
    def busy_s(self) -> float:
        return self.steps.busy_s

    async def sample(self, request: Request) -> Sampled:
        return await asyncio.wrap_future(self.steps.submit(request))

    async def serve(self) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, self.steps.run)
        finally:
            self._thread.shutdown(wait=False)

    def close(self) -> None:
        self.steps.close()


def turn_queue(engine: Generates, sampling: SamplingConfig, share: Share) -> TurnQueue:
    """Step by step where the engine has a step loop, else call by call."""
    if isinstance(engine, Steps):
        return StepQueue(engine, sampling, share)
    return CallQueue(engine, sampling, share)


async def _advance(
    t: Trajectory,
    started: Started,
    ids: list[int],
    finish: str,
    runner: EnvRunner,
    queue: TurnQueue,
    sampling: SamplingConfig,
    limits: TurnLimits,
    rollout_index: int,
) -> None:
    """``t`` to its end: its environment answers its last turn, then its next turn is sampled,
    and so on; nothing waits for another trajectory."""
    while True:
        stepped = await runner.step(started, ids, open_next(t, limits))
        take_answer(t, finish, answer_of(stepped), limits)
        if t.done:
            return
        request = Request(
            t.prompt_ids + t.response_ids,
            turn_budget(t, limits),
            turn_seed(sampling, rollout_index, t.sample, t.turns),
        )
        turn = await queue.sample(request)
        ids, finish = list(turn.ids), turn.finish
        t.add_model_turn(ids, list(turn.logprobs), turn.routes)


Pending = tuple[Trajectory, Started, list[int], str]  # after its first turn: ids, finish


async def _run_all(
    pending: Sequence[Pending],
    runner: EnvRunner,
    queue: TurnQueue,
    sampling: SamplingConfig,
    limits: TurnLimits,
    rollout_index: int,
) -> None:
    """Every pending trajectory to its end while ``queue`` serves their requests; the first
    failure (an engine call's) cancels the others and is raised."""
    server = asyncio.ensure_future(queue.serve())
    tasks = [
        asyncio.ensure_future(_advance(*p, runner, queue, sampling, limits, rollout_index))
        for p in pending
    ]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        queue.close()
        await server


def run_continuous(
    engine: Generates,
    starts: Sequence[SampleStart],
    runner: EnvRunner | None,
    sampling: SamplingConfig,
    limits: TurnLimits,
    *,
    rollout_index: int,
    pad_id: int,
    share: Share,
) -> list[Trajectory] | None:
    """The trajectories of ``starts`` (one environment instance each) on the executing rank
    (``runner``), each advancing as its own environment answers; None on the engine's other
    ranks, which make the executing rank's engine calls. Seeds and budgets as
    :func:`~megarl.rollout.multi_turn.run_trajectories`'."""
    started, trajectories = start_trajectories(starts, runner, rollout_index, pad_id, share)
    active = [k for k, t in enumerate(trajectories) if not t.done]
    model = []
    if active:  # every sample starts together: one call, as the lock-step loop's first turn
        ts = [trajectories[k] for k in active]
        model = model_turn(engine, ts, sampling, limits, rollout_index, share, runner is not None)
    if runner is None:
        follow_requests(engine, sampling, lambda: share(None))
        return None
    pending = [
        (trajectories[k], started[k], list(ids), finish)
        for k, (ids, _, finish, _) in zip(active, model, strict=True)
    ]
    queue = turn_queue(engine, sampling, share)
    t0 = time.perf_counter()
    try:
        runner.loop.run_until_complete(
            _run_all(pending, runner, queue, sampling, limits, rollout_index)
        )
    finally:
        share(None)  # the end: the other ranks stop following
    runner.add_seconds(time.perf_counter() - t0 - queue.busy_s)
    return trajectories


__all__ = ["CallQueue", "StepQueue", "TurnQueue", "run_continuous", "turn_queue"]
