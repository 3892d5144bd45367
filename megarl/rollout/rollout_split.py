"""How one rollout is split over the rollout engines and put back together, written once for the
colocated engine (:mod:`megarl.rollout.engine`) and the asynchronous rollout group
(:mod:`megarl.trainer.rollout_group`).

A rollout's prompts are those of every trainer data-parallel rank, in rank order: rank ``d``'s
prompts are ``[start_d, stop_d)`` of them (:func:`rank_bounds`). Engine ``e`` of ``E`` generates
the contiguous slice :func:`engine_slice`; every request carries the seed of its prompt's first
sample (:func:`prompt_seed`, :func:`engine_seeds`), so a sample's stream depends on its global
index and the rollout count only, never on how many engines there are. Each engine's
trajectories (one reply per sample, or an environment's or an agent's turns) come back from its
first rank and are put in sample order (:func:`~megarl.rollout.trajectory_source.step_of`), and
each trainer rank takes its share (:func:`megarl.rollout.rollout_batch.rank_batch`).

Pure: no collective runs here; the callers gather and broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from megarl.rollout.rollout_types import SamplingConfig
from megarl.rollout.seeds import request_seeds, sequence_seed

R = TypeVar("R")


@dataclass(frozen=True)
class SampleStart:
    """One multi-turn sample before its first turn."""

    sample: int  # index in the whole step
    row: dict[str, object]  # the dataset row reset() reads
    fallback_prompt: list[int]  # the row's own prompt ids (a failed reset's trajectory)


# -- slicing -------------------------------------------------------------------------------------
def engine_slice(prompts: int, engines: int, engine: int) -> tuple[int, int]:
    """``[lo, hi)`` of the step's ``prompts`` that engine ``engine`` of ``engines`` generates
    (contiguous; the slices' sizes differ by one at most)."""
    return engine * prompts // engines, (engine + 1) * prompts // engines


def rank_engine_slice(prompts: int, ranks: int, infer_tp: int, rank: int) -> tuple[int, int, int]:
    """Rank ``rank``'s engine (each engine owns ``infer_tp`` consecutive ranks of ``ranks``) and
    the ``[lo, hi)`` of the step's ``prompts`` that engine generates."""
    engine = rank // infer_tp
    lo, hi = engine_slice(prompts, ranks // infer_tp, engine)
    return engine, lo, hi


def rank_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` of each rank's prompts in the step's order, rank ``d`` holding
    ``counts[d]`` of them, consecutive."""
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def sample_starts(
    rows: Sequence[tuple[dict, list[int]]], lo: int, hi: int, n: int
) -> list[SampleStart]:
    """The samples of prompts ``[lo, hi)`` of a step's ``rows`` ((dataset row, fallback prompt
    ids) of every data-parallel rank in order), ``n`` each, numbered by their global index."""
    return [
        SampleStart(sample=g * n + j, row=rows[g][0], fallback_prompt=rows[g][1])
        for g in range(lo, hi)
        for j in range(n)
    ]


# -- seeding -------------------------------------------------------------------------------------
def prompt_seed(sampling: SamplingConfig, rollout: int, prompt: int) -> int:
    """The request seed of global prompt ``prompt`` in rollout ``rollout``: its first sample's
    stream (:mod:`megarl.rollout.seeds`); the engine seeds its sample ``j`` with this
    ``+ j``. A multi-turn first turn that asks for all ``n`` samples at once uses it too."""
    return sequence_seed(sampling.seed, rollout, prompt * max(1, sampling.n))


def engine_seeds(sampling: SamplingConfig, rollout: int, lo: int, hi: int) -> list[int]:
    """The request seeds of prompts ``[lo, hi)`` (:func:`prompt_seed` of each), checked at once
    against the samples a rollout can seed."""
    n = max(1, sampling.n)
    return request_seeds(sampling.seed, rollout, lo * n, hi - lo, n)


# -- merging -------------------------------------------------------------------------------------
def one_per_key(gathered: Sequence[tuple[int, R] | None]) -> list[tuple[int, R]]:
    """One ``(key, value)`` per key (an engine, a data-parallel rank), in key order, of what every
    rank sent (None from a rank with nothing to send; the ranks of one key send the same value:
    the first rank's is kept)."""
    first: dict[int, R] = {}
    for sent in gathered:
        if sent is not None:
            first.setdefault(sent[0], sent[1])
    return sorted(first.items(), key=lambda item: item[0])


# -- a rank's share ------------------------------------------------------------------------------
__all__ = [
    "SampleStart",
    "engine_seeds",
    "engine_slice",
    "one_per_key",
    "prompt_seed",
    "rank_bounds",
    "rank_engine_slice",
    "sample_starts",
]
