"""The endpoint's one need of a rollout engine: prompt token ids -> sampled ids, logprobs and why
the turn ended, one request at a time.

:class:`EngineGenerator` puts any engine with the multi-turn loop's ``generate`` seam
(:class:`~megarl.hybrid_engine.rollout_types.Generates`: the HF engine, vLLM's) behind it, with the
run's :class:`~megarl.hybrid_engine.rollout_types.SamplingConfig` and a lock: the endpoint's
request threads take turns on the engine. Batching requests of concurrent sessions into one
engine call is the continuous rollout's job, not this one's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from megarl.hybrid_engine.rollout_types import Generates, SamplingConfig


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


class EngineGenerator:
    """:class:`Generator` over a rollout engine, with the run's sampling settings."""

    def __init__(self, engine: Generates, sampling: SamplingConfig) -> None:
        self.engine = engine
        self.sampling = replace(sampling, n=1)
        self._lock = threading.Lock()

    def sample(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int) -> Sampled:
        with self._lock:
            out = self.engine.generate(
                [list(prompt_ids)], self.sampling, seeds=[seed], max_new_tokens=[max_new_tokens]
            )
        if len(out.token_ids) != 1:
            raise RuntimeError(f"the rollout engine returned {len(out.token_ids)} responses for 1")
        return Sampled(list(out.token_ids[0]), list(out.logprobs[0]), out.finish_reasons[0])
