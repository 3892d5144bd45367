"""Running an agent over a batch of samples: a bounded pool, a time limit per sample, a session
of the endpoint each, and what every sample gives back.

Each sample's agent runs once, with a copy of its dataset row, its session's base URL and the
served model's name; at most ``concurrency`` run at once. An ``async def`` agent runs in the
runner's event loop (one that blocks it without awaiting blocks every agent), a plain function
in a daemon thread of its own. An agent that raises, returns something other than a finite
number or None, sends no request, or runs past ``timeout_s`` gives its sample reward 0 and is
counted. The batch as a whole ends by ``batch_deadline_s``: an agent that waited for a place in
the pool starts with what is left of it, and not at all once it is spent (a timeout too), so a
queue behind slow agents cannot hold a step past the hang watchdog's limit. A timed-out agent's
session is closed (its later requests get HTTP 409) and its thread,
if a plain function, is left to end on its own: Python cannot stop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

from megarl.agents.endpoint import AgentEndpoint
from megarl.agents.loading import Agent, AgentResult
from megarl.envs.trajectory import Trajectory, check_env_failures
from megarl.metrics import StepMetrics, mean, total

T = TypeVar("T")
# how a sample's agent ended: ok | error (raised, or returned no reward) | timeout | no_requests
OUTCOMES = ("ok", "error", "timeout", "no_requests")


REQUESTS = "agent/requests"
SEGMENTS = "agent/segments"


def agent_metrics(totals: dict[str, float], seconds: float) -> dict[str, float]:
    """The ``agent/*`` metrics of ``totals`` (:meth:`AgentBatch.totals`, maybe summed over
    engines): the counters, requests and segments per sample, and the wall seconds (``agent/s``,
    the slowest engine's)."""
    n = max(totals.get("agent/samples", 0.0), 1.0)
    out = {k: v for k, v in totals.items() if k not in (REQUESTS, SEGMENTS)}
    out["agent/requests_mean"] = totals.get(REQUESTS, 0.0) / n
    out["agent/segments_mean"] = totals.get(SEGMENTS, 0.0) / n
    out["agent/s"] = float(seconds)
    return out


@dataclass(frozen=True)
class AgentLimits:
    concurrency: int = 8  # agents running at once
    timeout_s: float = 300.0  # one sample's agent, from its start to its return
    # every agent of a batch ends within this many seconds of the batch's start (None: no bound):
    # an agent queued behind slow ones starts with what is left, or not at all once it is spent
    batch_deadline_s: float | None = None

    def left(self, batch_start: float, now: float) -> float:
        """An agent's time limit when it starts at ``now``: its own, cut to the batch's deadline
        (0 or less: the deadline has passed)."""
        if self.batch_deadline_s is None:
            return self.timeout_s
        return min(self.timeout_s, batch_start + self.batch_deadline_s - now)


@dataclass
class AgentSample:
    sample: int  # the sample's index in the step
    segments: list[Trajectory]  # what the endpoint sampled in its session, in order
    reward: float | None  # the agent's (0.0 when it failed); None: the row's scorer decides
    outcome: str = "ok"
    error: str | None = None
    requests: int = 0
    non_continuations: int = 0

    @property
    def failed(self) -> bool:
        return self.outcome != "ok"

    def guard_view(self) -> Trajectory:
        """The sample as the failed-sample guard (check_env_failures) reads it."""
        t = Trajectory(sample=self.sample, prompt_ids=[])
        if self.failed:
            t.end("error", self.error)
        else:
            t.end("stop")
        return t


@dataclass
class AgentBatch:
    samples: list[AgentSample]
    counts: dict[str, int] = field(default_factory=dict)  # the endpoint's, over this batch
    seconds: float = 0.0

    def totals(self) -> dict[str, float]:
        """The batch's counters (summed over the engines of a step: :func:`agent_metrics`)."""
        out = {
            "agent/samples": float(len(self.samples)),
            "agent/failures": float(sum(s.outcome == "error" for s in self.samples)),
            "agent/timeouts": float(sum(s.outcome == "timeout" for s in self.samples)),
            "agent/no_requests": float(sum(s.outcome == "no_requests" for s in self.samples)),
            "agent/non_continuations": float(sum(s.non_continuations for s in self.samples)),
            REQUESTS: float(sum(s.requests for s in self.samples)),
            SEGMENTS: float(sum(len(s.segments) for s in self.samples)),
        }
        for name, count in sorted(self.counts.items()):
            out[f"agent/{name}"] = float(count)
        return out

    def metrics(self) -> StepMetrics:
        return {
            k: mean(v) if k.endswith("_mean") or k == "agent/s" else total(v)
            for k, v in agent_metrics(self.totals(), self.seconds).items()
        }

    def check_failures(self, max_failed_share: float) -> None:
        """The run's failed-sample guard (rollout.environment.max_env_failures): an EnvError showing the
        first failure when more than that share of the batch failed."""
        check_env_failures([s.guard_view() for s in self.samples], max_failed_share)


def _in_thread(fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
    """``fn(*args)`` in a daemon thread, as a future of this loop (the thread is not waited for
    when the future is cancelled)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(cast(T, result))

    def target() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # handed to the loop as the agent's failure
            result, error = None, e
        # a RuntimeError: the loop has ended, nobody waits for this agent any more
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name="megarl-agent", daemon=True).start()
    return future


async def _call(agent: Agent, row: dict[str, object], base_url: str, model: str) -> AgentResult:
    if agent.is_async:
        value = agent.fn(row, base_url, model)
        assert isinstance(value, Awaitable)
        result: object = await value
    else:
        result = await _in_thread(agent.fn, row, base_url, model)
        if isinstance(result, Awaitable):  # a plain function that returned a coroutine
            result = await result
    return _check_reward(result)


class BadReward(Exception):
    pass


def _check_reward(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadReward(
            f"the agent returned {value!r:.80}; it must return a finite number (the reward) or "
            "None (the row's scorer scores the final reply)"
        )
    return float(value)


async def _one(
    agent: Agent,
    endpoint: AgentEndpoint,
    sample: int,
    row: dict[str, object],
    limits: AgentLimits,
    pool: asyncio.Semaphore,
    batch_start: float,
) -> AgentSample:
    async with pool:
        time_limit = limits.left(batch_start, time.monotonic())
        if time_limit <= 0:
            return _past_deadline(sample, limits)
        key, base_url = endpoint.open_session(sample)
        outcome, error, reward = "ok", None, None
        try:
            reward = await asyncio.wait_for(
                _call(agent, dict(row), base_url, endpoint.settings.model), time_limit
            )
        except TimeoutError:
            outcome = "timeout"
            error = (
                f"the agent did not return within {limits.timeout_s:g} s (its time limit)"
                if time_limit == limits.timeout_s
                else f"the agent did not return by the batch's deadline ({time_limit:.3g} s left "
                f"at its start of the {limits.batch_deadline_s:g} s every agent of a step shares)"
            )
        except Exception as e:
            outcome = "error"
            error = f"the agent {agent.spec} raised:\n{''.join(traceback.format_exception(e))}"
        session = await asyncio.to_thread(endpoint.close_session, key)
        endpoint.forget(key)
    if outcome == "ok" and session.requests == 0:
        outcome, error = "no_requests", "the agent returned without sending the endpoint a request"
    segments = session.trajectories()
    if outcome != "ok":
        reward = 0.0
        if segments:
            segments[-1].finish, segments[-1].error = "error", error
    return AgentSample(
        sample=sample,
        segments=segments,
        reward=reward,
        outcome=outcome,
        error=error,
        requests=session.requests,
        non_continuations=session.non_continuations,
    )


def _past_deadline(sample: int, limits: AgentLimits) -> AgentSample:
    """A sample whose agent never started: the batch's deadline had passed when a place in the
    pool came free (reward 0, counted as a timeout)."""
    return AgentSample(
        sample=sample,
        segments=[],
        reward=0.0,
        outcome="timeout",
        error=f"the agent was not started: the {limits.batch_deadline_s:g} s every agent of a "
        "step shares had passed while it waited for a place in the pool (agents ahead of it ran "
        "long); raise rollout.agent_concurrency, lower rollout.agent_timeout_s or raise "
        "trainer.hang_timeout_s",
    )


async def run_agents_async(
    agent: Agent,
    endpoint: AgentEndpoint,
    rows: Sequence[tuple[int, dict[str, object]]],
    limits: AgentLimits,
) -> AgentBatch:
    """Every (sample index, row) of ``rows`` through ``agent`` against ``endpoint`` (started),
    ``limits.concurrency`` at once; samples come back in the order of ``rows``."""
    start = time.monotonic()
    endpoint.take_counts()  # this batch's counts only
    pool = asyncio.Semaphore(limits.concurrency)
    samples = await asyncio.gather(
        *(_one(agent, endpoint, sample, row, limits, pool, start) for sample, row in rows)
    )
    return AgentBatch(list(samples), endpoint.take_counts(), time.monotonic() - start)


def run_agents(
    agent: Agent,
    endpoint: AgentEndpoint,
    rows: Sequence[tuple[int, dict[str, object]]],
    limits: AgentLimits,
) -> AgentBatch:
    """:func:`run_agents_async` from synchronous code (no event loop running in this thread)."""
    return asyncio.run(run_agents_async(agent, endpoint, rows, limits))
