"""The rollout's split over engines and back (megarl.rollout.rollout_split), shared by the
colocated engine and the asynchronous rollout group: the engines' slices cover the step once,
every request carries its prompt's first-sample seed (as the seeds module documents, and as
the engine computed it before this module existed), and slicing, generating one reply per sample
(the one-reply trajectory source), gathering and taking each rank's share back leaves every
response in its prompt's place."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megarl.envs.base import EnvError
from megarl.envs.trajectory import Trajectory
from megarl.rollout.one_reply import OneReplySource, prompts_of
from megarl.rollout.rollout_batch import rank_batch
from megarl.rollout.rollout_split import (
    SampleStart,
    engine_seeds,
    engine_slice,
    one_per_key,
    prompt_seed,
    rank_bounds,
    rank_engine_slice,
    sample_starts,
)
from megarl.rollout.rollout_types import RolloutOutput, SamplingConfig
from megarl.rollout.seeds import request_seeds, sample_seeds, sequence_seed
from megarl.rollout.trajectory_source import EngineJob, EngineTrajectories, step_of

pytestmark = pytest.mark.unit


# -- slicing -------------------------------------------------------------------------------------
@given(prompts=st.integers(0, 200), engines=st.integers(1, 16))
def test_engine_slices_cover_the_step_once_in_order_and_evenly(prompts, engines):
    slices = [engine_slice(prompts, engines, e) for e in range(engines)]
    assert slices[0][0] == 0 and slices[-1][1] == prompts
    assert all(a[1] == b[0] for a, b in itertools.pairwise(slices))  # contiguous, in order
    sizes = [hi - lo for lo, hi in slices]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1


def test_an_engines_tensor_parallel_ranks_share_its_slice():
    # 8 ranks, engines of 2 consecutive ranks: 4 engines over 10 prompts
    got = [rank_engine_slice(10, 8, 2, r) for r in range(8)]
    slices = [(0, 0, 2), (1, 2, 5), (2, 5, 7), (3, 7, 10)]
    assert got == [s for s in slices for _ in range(2)]


def test_rank_bounds_are_consecutive():
    assert rank_bounds([2, 3, 0, 1]) == [(0, 2), (2, 5), (5, 5), (5, 6)]
    assert rank_bounds([]) == []


def test_sample_starts_number_samples_by_their_global_index():
    rows = [({"id": g}, [g, g]) for g in range(4)]
    starts = sample_starts(rows, 1, 3, 2)
    assert starts == [
        SampleStart(2, {"id": 1}, [1, 1]),
        SampleStart(3, {"id": 1}, [1, 1]),
        SampleStart(4, {"id": 2}, [2, 2]),
        SampleStart(5, {"id": 2}, [2, 2]),
    ]


# -- seeding -------------------------------------------------------------------------------------
def test_request_seeds_are_the_seeds_of_each_prompts_first_sample():
    """What the seeds module documents (request ``i`` carries the seed of its first sample,
    ``i * n``), and what the colocated engine and the multi-turn first turn computed before this
    module (their expressions, written out here)."""
    sampling = SamplingConfig(n=8, seed=1)
    seeds = engine_seeds(sampling, 3, 5, 8)
    assert seeds == [sequence_seed(1, 3, p * 8) for p in (5, 6, 7)]
    assert seeds == [prompt_seed(sampling, 3, p) for p in (5, 6, 7)]
    # HybridEngine.generate: request_seeds(sampling.seed, rollouts, lo * sampling.n, hi - lo, n)
    assert seeds == request_seeds(1, 3, 5 * 8, 8 - 5, 8)
    # multi_turn.first_turn_seed(sampling, rollout, prompt): sequence_seed(seed, rollout, p * n)
    assert prompt_seed(SamplingConfig(n=4, seed=7), 2, 11) == sequence_seed(7, 2, 44)
    # one sample per prompt: consecutive prompts, consecutive samples' seeds
    one = SamplingConfig(n=1, seed=2**40 + 5)
    assert engine_seeds(one, 0, 0, 2) == [sequence_seed(2**40 + 5, 0, k) for k in (0, 1)]


@given(prompts=st.integers(1, 64), engines=st.integers(1, 8), n=st.integers(1, 8))
def test_seeds_do_not_depend_on_the_number_of_engines(prompts, engines, n):
    sampling = SamplingConfig(n=n, seed=3)
    split = [
        s
        for e in range(engines)
        for s in engine_seeds(sampling, 4, *engine_slice(prompts, engines, e))
    ]
    assert split == engine_seeds(sampling, 4, 0, prompts)
    assert split == [sequence_seed(3, 4, p * n) for p in range(prompts)]
    # and vLLM's "+ j" makes them every sample's own, in prompt-major order
    assert sample_seeds(split, n) == [sequence_seed(3, 4, k) for k in range(prompts * n)]


def test_a_step_too_large_to_seed_is_refused():
    with pytest.raises(ValueError, match="samples per rollout"):
        engine_seeds(SamplingConfig(n=8, seed=0), 0, 2**21 - 1, 2**21 + 1)


# -- generating, gathering and taking back ------------------------------------------------------
class _NamingEngine:
    """Sample j of a request for prompt ``[p]`` is ``[p, j]``, with its seed as its logprobs; a
    sample of an odd prompt runs out of tokens. Records every call's prompts."""

    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []

    def generate(self, prompts, sampling, seed_offset=0, *, seeds=None, max_new_tokens=None):
        self.calls.append([list(p) for p in prompts])
        out = RolloutOutput()
        for i, p in enumerate(prompts):
            for j in range(sampling.n):
                out.prompt_index.append(i)
                out.token_ids.append([p[0], j])
                out.logprobs.append([float(seeds[i]), float(seeds[i] + j)])
                out.finish_reasons.append("length" if p[0] % 2 else "stop")
        return out


@pytest.mark.parametrize(
    ("counts", "ranks", "infer_tp", "n"),
    [([3, 2], 4, 2, 2), ([1, 1, 1, 1], 4, 1, 3), ([5, 0, 4], 6, 3, 1), ([2, 2], 2, 2, 4)],
)
def test_one_reply_per_sample_over_engines_then_each_ranks_share_keeps_every_reply_in_place(
    counts, ranks, infer_tp, n
):
    total = sum(counts)
    sampling = SamplingConfig(n=n, seed=11)
    rows = [({"prompt": str(p)}, [p]) for p in range(total)]
    sent = []
    for rank in range(ranks):
        engine, lo, hi = rank_engine_slice(total, ranks, infer_tp, rank)
        starts = sample_starts(rows, lo, hi, n)
        fake = _NamingEngine()
        leader = rank % infer_tp == 0
        job = EngineJob(fake, starts, 3, leader, lambda value: value, version=engine)
        part = OneReplySource(sampling).run(job)
        # every rank of an engine makes the same call: its prompts, each once, n samples each
        assert fake.calls == [[[p] for p in range(lo, hi)]]
        assert (part is not None) == leader
        sent.append((engine, part) if part is not None else None)
    random.Random(0).shuffle(sent)  # gathered in any order
    _, step = step_of(sent, max_failed_share=0.0)
    assert [t.sample for t in step] == list(range(total * n))
    owner = {
        p: rank_engine_slice(total, ranks, infer_tp, r)[0]
        for r in range(ranks)
        for p in range(*rank_engine_slice(total, ranks, infer_tp, r)[1:])
    }
    for t in step:
        p, j = divmod(t.sample, n)
        assert t.prompt_ids == [p] and t.response_ids == [p, j] and t.mask == [1, 1]
        seed = prompt_seed(sampling, 3, p)  # the request's seed, its samples' seed + j
        assert t.logprobs == [float(seed), float(seed + j)]
        assert t.finish == ("length" if p % 2 else "stop") and t.turns == 1
        assert t.versions == [owner[p]] * 2  # the version its engine generated at
    shares = []
    for start, stop in rank_bounds(counts):
        share = rank_batch(step, start, stop, n, conversations=False)
        assert share.prompt_index == [p - start for p in range(start, stop) for _ in range(n)]
        assert share.response_masks is None  # plain replies: every token the model's
        assert [t.sample // n for t in share.trajectories] == [
            p for p in range(start, stop) for _ in range(n)
        ]
        shares += [t.response_ids for t in share.trajectories]
    # every rank's share, in rank order, is the whole step again
    assert shares == [[p, j] for p in range(total) for j in range(n)]


def test_one_reply_keeps_the_engines_routes_and_finish_reason_and_refuses_a_broken_split():
    class Routed(_NamingEngine):
        def generate(self, prompts, sampling, seed_offset=0, *, seeds=None, max_new_tokens=None):
            out = super().generate(prompts, sampling, seeds=seeds)
            out.finish_reasons = ["abort"] * len(out.token_ids)
            out.routes = [
                torch.full((3, 1, 1), k, dtype=torch.int16) for k in range(len(out.token_ids))
            ]
            return out

    starts = sample_starts([({}, [4]), ({}, [5])], 0, 2, 1)
    job = EngineJob(Routed(), starts, 0, True, lambda value: value)
    part = OneReplySource(SamplingConfig(n=1)).run(job)
    assert part is not None
    assert [t.finish for t in part.trajectories] == ["abort", "abort"]  # the engine's own
    assert [int(t.routes[0, 0, 0]) for t in part.trajectories] == [0, 1]
    assert part.trajectories[0].routes.shape == (3, 1, 1)  # prompt + reply, as recorded
    with pytest.raises(ValueError, match="not 2 per prompt"):
        prompts_of(sample_starts([({}, [4])], 0, 1, 3), 2)  # 3 samples of one prompt
    with pytest.raises(ValueError, match="not the first of prompt"):
        prompts_of(sample_starts([({}, [4]), ({}, [5])], 0, 2, 2)[1:3], 2)


def test_the_first_ranks_value_of_each_key_is_kept_in_key_order():
    gathered = [(2, "c0"), None, (0, "a0"), (2, "c1"), (1, "b0"), (0, "a1")]
    assert one_per_key(gathered) == [(0, "a0"), (1, "b0"), (2, "c0")]


def _trajectory(sample: int) -> Trajectory:
    t = Trajectory(sample=sample, prompt_ids=[sample])
    t.add_model_turn([sample, sample], [-0.1, -0.2])
    t.end("stop")
    return t


def test_engine_trajectories_merge_in_engine_order_and_each_rank_takes_its_own():
    n = 2
    gathered = [
        (1, EngineTrajectories([_trajectory(4), _trajectory(5)], 0.5)),
        None,  # a rank that ran no environment
        (0, EngineTrajectories([_trajectory(s) for s in range(4)], 2.0)),
        None,
    ]
    parts, step = step_of(gathered, max_failed_share=0.0)
    assert [t.sample for t in step] == list(range(6))
    assert [part.seconds for part in parts] == [2.0, 0.5]  # engine order
    failed = _trajectory(6)
    failed.finish, failed.error = "error", "the tool broke"
    gathered.append((2, EngineTrajectories([failed], 0.0)))
    assert len(step_of(gathered, max_failed_share=1 / 7)[1]) == 7  # one of seven may fail
    with pytest.raises(EnvError, match="the tool broke"):
        step_of(gathered, max_failed_share=0.1)
    batch = rank_batch(step, 1, 3, n)  # prompts 1 and 2: samples 2..5
    assert [t.sample for t in batch.trajectories] == [2, 3, 4, 5]
    assert batch.prompt_index == [0, 0, 1, 1]
    assert batch.sequences() == [[s, s, s] for s in range(2, 6)]
    assert batch.response_masks == [[1, 1]] * 4 and batch.finish_reasons == ["stop"] * 4
    assert batch.routes is None  # none recorded


def test_a_batch_record_gives_its_routes_whole_or_not_at_all():
    """rank_batch shapes -1 routes for a sample no call routed, so a record holds routes for
    every sample or none; one that holds some is refused rather than trained misaligned."""
    routed = _trajectory(0)
    routed.routes = torch.zeros((3, 1, 2), dtype=torch.int16)
    batch = rank_batch([routed, _trajectory(1)], 0, 1, 2)
    assert batch.routes is not None and batch.routes[1].tolist() == [[[-1, -1]]] * 3
    batch.trajectories[1].routes = None
    with pytest.raises(RuntimeError, match="some samples of a batch carry routes"):
        _ = batch.routes
