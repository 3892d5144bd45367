"""One ``generate`` call of a rollout engine as the drivers that batch requests see it: its
requests (prompt ids, token limit, seed each), its results (:class:`Sampled`), and the other ranks
of an engine repeating the calls its first rank makes (:func:`follow_requests`).

Both continuous drivers build on it: the agents' endpoint (:mod:`megarl.agents.generation`) and the
environments' continuous turn loop (:mod:`megarl.rollout.continuous`). An engine spread over
several ranks (vLLM at tensor-parallel 2, say) needs every one of its ranks in each call, while the
driver runs on the first rank only: each call is first announced to the others (a broadcast over
the engine's ranks), which make the same call until the first rank announces the end (None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

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


class EngineFailed(RuntimeError):
    """The engine call (or its announcement to the other ranks) that held a request failed."""


def follow_requests(
    engine: Generates, sampling: SamplingConfig, receive: Callable[[], EngineCall | None]
) -> int:
    """On an engine's other ranks: make each call the first rank announces (``receive``) until
    it announces the end (None); how many were made."""
    sampling = replace(sampling, n=1)
    made = 0
    while (call := receive()) is not None:
        call.make(engine, sampling)
        made += 1
    return made
