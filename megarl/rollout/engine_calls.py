"""One ``generate`` call of a rollout engine as the drivers that batch requests see it: its
requests (prompt ids, token limit, seed each), its results (:class:`Sampled`), and the other ranks
of an engine repeating the calls its first rank makes (:func:`follow_requests`). An engine with a
step loop of its own (:class:`Steps`: vLLM's) is driven one step at a time instead
(:class:`EngineStep`, :mod:`megarl.rollout.step_loop`), so a request joins the running batch at
the engine's next step rather than waiting for a whole call to end.

Both continuous drivers build on it: the agents' endpoint (:mod:`megarl.agents.generation`) and the
environments' continuous turn loop (:mod:`megarl.rollout.continuous`). An engine spread over
several ranks (vLLM at tensor-parallel 2, say) needs every one of its ranks in each call, while the
driver runs on the first rank only: each call is first announced to the others (a broadcast over
the engine's ranks), which make the same call until the first rank announces the end (None).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch

from megarl.rollout.rollout_types import Generates, SamplingConfig

DEFAULT_WINDOW_S = 0.002  # how long a call waits for requests arriving with the first one


@dataclass(frozen=True)
class Sampled:
    ids: list[int]  # as sampled, the stop token included when the turn stopped
    logprobs: list[float]  # the engine's, one per id
    finish: str  # "stop" (a stop token ended it) | "length" (its token limit did)
    # actor.router_replay: the engine's experts of every prompt id and sampled id, [ids, MoE
    # layers, top_k] int16 (-1: none; megarl.envs.trajectory.Trajectory.routes); None: not recorded
    routes: torch.Tensor | None = None


@dataclass(frozen=True)
class Request:
    """One model turn as the engine is asked for it."""

    prompt_ids: list[int]
    max_new_tokens: int
    seed: int


@dataclass(frozen=True)
class EngineCall:
    """One ``generate`` call of the engine: its requests, in order (what the other ranks of an
    engine repeat)."""

    requests: tuple[Request, ...]

    def make(self, engine: Generates, sampling: SamplingConfig) -> list[Sampled]:
        """Each request's turn, in order (``sampling.n`` is 1: one response per request)."""
        out = engine.generate(
            [r.prompt_ids for r in self.requests],
            sampling,
            seeds=[r.seed for r in self.requests],
            max_new_tokens=[r.max_new_tokens for r in self.requests],
        )
        if list(out.prompt_index) != list(range(len(self.requests))):
            raise RuntimeError(
                f"the rollout engine returned {len(out.token_ids)} responses for "
                f"{len(self.requests)} requests"
            )
        routes = out.routes or [None] * len(out.token_ids)
        return [
            Sampled(list(ids), list(lps), finish, r)
            for ids, lps, finish, r in zip(
                out.token_ids, out.logprobs, out.finish_reasons, routes, strict=True
            )
        ]

    def apply(self, engine: Generates, sampling: SamplingConfig) -> None:
        """On an engine's other ranks: the same call."""
        self.make(engine, sampling)


@runtime_checkable
class Steps(Protocol):
    """An engine that takes new requests between the steps of its own loop (vLLM's engine: one
    step schedules and runs one forward of every running request)."""

    def add_requests(
        self, requests: Sequence[tuple[str, Request]], sampling: SamplingConfig
    ) -> None:
        """Queue each ``(id, request)`` (one response each) for the next step."""
        ...

    def step(self) -> list[tuple[str, Sampled]]:
        """One step of the engine; the requests it finished, by id."""
        ...


@dataclass(frozen=True)
class EngineStep:
    """One step of a :class:`Steps` engine and the requests added just before it (what the other
    ranks of an engine repeat, so every rank's scheduler sees the same requests at the same
    step)."""

    added: tuple[tuple[str, Request], ...]

    def make(self, engine: Steps, sampling: SamplingConfig) -> list[tuple[str, Sampled]]:
        if self.added:
            engine.add_requests(self.added, sampling)
        return engine.step()

    def apply(self, engine: Generates, sampling: SamplingConfig) -> None:
        """On an engine's other ranks: the same additions and step."""
        if not isinstance(engine, Steps):
            raise TypeError(
                f"the engine's first rank drives it step by step, but this rank's "
                f"{type(engine).__name__} has no step loop (every rank of an engine must run "
                f"the same backend)"
            )
        self.make(engine, sampling)


EngineMessage = EngineCall | EngineStep  # what an engine's first rank announces to the others


def engine_thread_setup() -> Callable[[], None]:
    """What a thread that drives the engine runs first: the OpenMP thread count of the thread
    calling this (the rank's). A new thread starts at OpenMP's default (the cores) until torch
    first asks, and vLLM's CPU attention refuses a step planned with one count and run with
    another ("Check failed: input->metadata->thread_num == thread_num"). vLLM replaces
    ``torch.set_num_threads`` with a no-op once started, hence torch's own setter."""
    threads = torch.get_num_threads()

    def setup() -> None:
        torch._C.set_num_threads(threads)

    return setup


class EngineFailed(RuntimeError):
    """The engine call (or its announcement to the other ranks) that held a request failed."""

    @classmethod
    def of(cls, error: BaseException) -> EngineFailed:
        """The failure every request of the call or step gets, naming the engine's ``error``."""
        failure = cls(f"the rollout engine failed: {type(error).__name__}: {error}")
        failure.__cause__ = error
        return failure


def follow_requests(
    engine: Generates, sampling: SamplingConfig, receive: Callable[[], EngineMessage | None]
) -> int:
    """On an engine's other ranks: make each call or step the first rank announces
    (``receive``) until it announces the end (None); how many were made."""
    sampling = replace(sampling, n=1)
    made = 0
    while (message := receive()) is not None:
        message.apply(engine, sampling)
        made += 1
    return made
