"""The endpoint's one need of a rollout engine: prompt token ids -> sampled ids, logprobs and why
the turn ended, one request at a time.

:class:`EngineGenerator` puts any engine with the multi-turn loop's ``generate`` seam
(:class:`~megarl.hybrid_engine.rollout_types.Generates`: the HF engine, vLLM's) behind it, with the
run's :class:`~megarl.hybrid_engine.rollout_types.SamplingConfig` and a lock: the endpoint's
request threads take turns on the engine. Batching requests of concurrent sessions into one
engine call is the continuous rollout's job, not this one's.

An engine spread over several ranks (vLLM at tensor-parallel 2, say) needs every one of its ranks
in each ``generate`` call, while the endpoint runs on the first rank only: there each request is
first announced to the others (``announce``, a broadcast over the engine's ranks), which make the
same call (:func:`follow_requests`) until the first rank announces the end (None).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from megarl.hybrid_engine.rollout_types import Generates, RolloutOutput, SamplingConfig


@dataclass(frozen=True)
class Sampled:
    ids: list[int]  # as sampled, the stop token included when the turn stopped
    logprobs: list[float]  # the engine's, one per id
    finish: str  # "stop" (a stop token ended it) | "length" (its token limit did)


class Generator(Protocol):
    def sample(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int) -> Sampled:
        """One model turn after ``prompt_ids``: at most ``max_new_tokens`` new tokens drawn from
        the stream ``seed`` names."""
        ...


@dataclass(frozen=True)
class Request:
    """One model turn as the engine is asked for it (what the other ranks of an engine repeat)."""

    prompt_ids: list[int]
    max_new_tokens: int
    seed: int

    def make(self, engine: Generates, sampling: SamplingConfig) -> RolloutOutput:
        return engine.generate(
            [self.prompt_ids],
            sampling,
            seeds=[self.seed],
            max_new_tokens=[self.max_new_tokens],
        )


class EngineGenerator:
    """:class:`Generator` over a rollout engine, with the run's sampling settings; ``announce``
    hands each request to the engine's other ranks first (None: the engine is this rank's)."""

    def __init__(
        self,
        engine: Generates,
        sampling: SamplingConfig,
        announce: Callable[[Request], object] | None = None,
    ) -> None:
        self.engine = engine
        self.sampling = replace(sampling, n=1)
        self.announce = announce
        self._lock = threading.Lock()

    def sample(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int) -> Sampled:
        request = Request(list(prompt_ids), max_new_tokens, seed)
        with self._lock:
            if self.announce is not None:
                self.announce(request)
            out = request.make(self.engine, self.sampling)
        if len(out.token_ids) != 1:
            raise RuntimeError(f"the rollout engine returned {len(out.token_ids)} responses for 1")
        return Sampled(list(out.token_ids[0]), list(out.logprobs[0]), out.finish_reasons[0])


def follow_requests(
    engine: Generates, sampling: SamplingConfig, receive: Callable[[], Request | None]
) -> int:
    """On an engine's other ranks: make each request the first rank announces (``receive``)
    until it announces the end (None); how many were made."""
    sampling = replace(sampling, n=1)
    made = 0
    while (request := receive()) is not None:
        request.make(engine, sampling)
        made += 1
    return made
