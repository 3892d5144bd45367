"""Every sampled sequence of a run draws its own random stream (megarl.rollout.seeds).

vLLM seeds sample j of a request seeded s with s + j; seeding consecutive prompts consecutively
made sample j of prompt i and sample j-1 of prompt i+1 share a stream (45 of 64 sequences of a
two-step quickstart run shared theirs with another). Checked here: no two sequences of a step
share one, at any number of engines (the same seeds in the same places: layout-invariant), nor
across steps, validation passes, multi-turn turns and partial-rollout rounds; the colocated
engine, a resumed engine and the asynchronous rollout group's generation all seed alike.

CPU generators keep only a seed's low 32 bits: those bits must differ between rollouts and
segments too, or every step of a CPU run redraws the first step's streams by sample position
(and dynamic sampling's redraw of a prompt gives back the same responses)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megarl.parallel import ParallelLayout
from megarl.rollout import engine as engine_module
from megarl.rollout.engine import HybridEngine
from megarl.rollout.hf_rollout import HFRollout
from megarl.rollout.multi_turn import turn_seed
from megarl.rollout.rollout_split import engine_slice, prompt_seed
from megarl.rollout.rollout_types import RolloutOutput, SamplingConfig
from megarl.rollout.seeds import (
    LOW_BITS,
    SEQUENCE_BITS,
    request_seeds,
    sample_seeds,
    sequence_seed,
)
from megarl.rollout.versioned import generate_versioned
from tests.assets import tiny_char_llama_dir

RUN_SEED, PROMPTS, N = 1, 32, 8  # the quickstart's seed; a step of 32 prompts x 8 samples


def _step(rollout: int, engines: int, prompts: int = PROMPTS, n: int = N) -> list[int]:
    """Every sample's seed in a step, in global prompt-major order, as ``engines`` engines draw
    them (each its share of the prompts, as the colocated engine and the rollout group split
    them)."""
    out = []
    for e in range(engines):
        lo, hi = engine_slice(prompts, engines, e)
        out += sample_seeds(request_seeds(RUN_SEED, rollout, lo * n, hi - lo, n), n)
    return out


@pytest.mark.parametrize("engines", [1, 2, 3, 4, 8, 32])
def test_no_two_sequences_of_a_step_share_a_stream_at_any_layout(engines):
    seeds = _step(rollout=1, engines=engines)
    assert len(seeds) == PROMPTS * N == len(set(seeds))
    assert seeds == _step(rollout=1, engines=1)  # the same stream in the same place
    assert all(0 <= s < 2**63 for s in seeds)


def test_steps_validation_turns_and_rounds_draw_apart():
    """Rollouts 0-5 (training steps, a dynamic-sampling redraw and validation passes each count
    one), later turns of multi-turn samples, partial-rollout continuations: all distinct."""
    everything = [s for r in range(6) for s in _step(r, engines=4)]
    later_turns = [
        turn_seed(SamplingConfig(n=N, seed=RUN_SEED), r, sample, turn)
        for r in range(6)
        for sample in range(PROMPTS * N)
        for turn in (1, 2, 3)
    ]
    rounds = [
        sequence_seed(RUN_SEED, r, k, segment=round_)
        for r in range(6)
        for k in range(PROMPTS * N)
        for round_ in (1, 2)
    ]
    # a run has later turns (rollout.env) or continuation rounds (rollout.placement.partial), never both
    # (the config refuses the pair): each is its own segment of the sample
    for every in (everything + later_turns, everything + rounds):
        assert len(set(every)) == len(every)


def test_the_first_turn_of_a_multi_turn_sample_is_the_single_turn_sample():
    sampling = SamplingConfig(n=N, seed=RUN_SEED)
    step = _step(rollout=3, engines=2)
    for prompt, j in itertools.product(range(PROMPTS), range(N)):
        sample = prompt * N + j
        assert prompt_seed(sampling, 3, prompt) + j == step[sample]
        assert turn_seed(sampling, 3, sample, 0) == step[sample]


def test_runs_with_another_seed_draw_other_streams():
    other = [sequence_seed(RUN_SEED + 1, 1, k) for k in range(PROMPTS * N)]
    assert not set(other) & set(_step(rollout=1, engines=1))


@given(
    a=st.tuples(st.integers(0, 2**20), st.integers(0, 2**10 - 1), st.integers(0, 2**24 - 1)),
    b=st.tuples(st.integers(0, 2**20), st.integers(0, 2**10 - 1), st.integers(0, 2**24 - 1)),
    run_seed=st.integers(0, 2**64),
)
def test_distinct_places_in_a_run_have_distinct_seeds(a, b, run_seed):
    (ra, sa, qa), (rb, sb, qb) = a, b
    seed_a = sequence_seed(run_seed, ra, qa, segment=sa)
    seed_b = sequence_seed(run_seed, rb, qb, segment=sb)
    assert (seed_a == seed_b) == (a == b)
    assert 0 <= seed_a < 2**63
    # the engine's seed + j for the later samples of a request, up to the rollout's last
    # sample, stays in the low bits: it never carries into (rollout, segment)
    assert seed_a % 2**LOW_BITS + (2**SEQUENCE_BITS - 1 - qa) < 2**LOW_BITS


def test_a_cpu_generator_keeps_only_the_low_32_bits_of_a_seed():
    """The hazard: torch's CPU generator (mt19937) draws alike from seeds 2**32 apart."""
    seed = sequence_seed(RUN_SEED, 1, 3)
    draws = [
        torch.rand(8, generator=torch.Generator().manual_seed(s)) for s in (seed, seed + 2**32)
    ]
    assert torch.equal(*draws)


def test_rollouts_and_segments_draw_apart_in_the_low_32_bits():
    """200 rollouts x 256 samples x 3 segments: no two places share their low 32 bits, so a
    CPU generator draws each its own stream (not guaranteed by the layout as it is for the full
    seed, but each (rollout, segment) starts its sequences at a mixed offset)."""
    rollouts, samples, segments = 200, 256, 3
    low = {
        sequence_seed(RUN_SEED, r, k, segment=g) % 2**LOW_BITS
        for r in range(rollouts)
        for g in range(segments)
        for k in range(samples)
    }
    assert len(low) == rollouts * samples * segments
    # and so a CPU generator seeded for one sample position draws apart from step to step
    first = [
        torch.rand(4, generator=torch.Generator().manual_seed(sequence_seed(RUN_SEED, r, 3)))
        for r in range(4)
    ]
    assert all(not torch.equal(first[0], other) for other in first[1:])


def test_a_step_too_large_to_seed_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"data.train_batch_size x rollout.sampling.n"):
        request_seeds(RUN_SEED, 0, 2**24 - 7, 1, 8)  # its last sample would be sample 2^24
    assert len(request_seeds(RUN_SEED, 0, 2**24 - 8, 1, 8)) == 1  # 2^24 samples: the most


class _Recording:
    """A rollout engine recording the seeds it is given; ``n`` samples per request."""

    infer_tp = 1
    backend = "fake"

    def __init__(self) -> None:
        self.seeds: list[list[int]] = []

    def generate(self, prompts, sampling, seed_offset=0, *, seeds=None, max_new_tokens=None):
        assert seeds is not None, "a run seeds every request"
        self.seeds.append(list(seeds))
        out = RolloutOutput()
        for i, _ in enumerate(prompts):
            for _ in range(sampling.n):
                out.prompt_index.append(i)
                out.token_ids.append([1])
                out.logprobs.append([-1.0])
                out.finish_reasons.append("stop")
        return out


def _one_rank_engine(monkeypatch, rollouts: int = 0) -> HybridEngine:
    """The colocated engine's generate in a world of one rank (no process group)."""
    monkeypatch.setattr(engine_module.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(
        engine_module.dist, "all_gather_object", lambda out, obj: out.__setitem__(0, obj)
    )
    engine = object.__new__(HybridEngine)
    engine.layout = ParallelLayout(tp=1, pp=1, dp=1, infer_tp=1)
    engine.rank, engine.dp_rank = 0, 0
    engine._engine_leader, engine._engine_group = 0, None  # the engine's one rank leads it
    engine.rollout = _Recording()
    engine.rollout_count = rollouts
    return engine


def test_the_colocated_engine_seeds_every_sample_its_own_stream_and_resumes_alike(monkeypatch):
    sampling = SamplingConfig(n=N, seed=RUN_SEED, max_new_tokens=1)
    prompts = [[7, k] for k in range(PROMPTS)]
    engine = _one_rank_engine(monkeypatch)
    for _ in range(3):
        engine.generate(prompts, sampling)
    assert [sample_seeds(s, N) for s in engine.rollout.seeds] == [_step(r, 1) for r in range(3)]
    # a run resumed after two rollouts (rollout_count restored from its checkpoint) draws the
    # third rollout's streams, as the uninterrupted run did
    resumed = _one_rank_engine(monkeypatch, rollouts=2)
    resumed.generate(prompts, sampling)
    assert resumed.rollout.seeds == engine.rollout.seeds[2:]


def test_a_redraw_of_a_prompt_on_the_hf_cpu_backend_samples_other_responses(monkeypatch):
    """Dynamic sampling's redraw of a prompt is the next rollout: on CPU it must not give back
    the responses the first draw gave."""
    sampling = SamplingConfig(n=4, seed=RUN_SEED, max_new_tokens=12, stop_token_ids=[])
    engine = _one_rank_engine(monkeypatch)
    engine.rollout = HFRollout(tiny_char_llama_dir())
    prompt = [[5, 6, 7, 8]]
    first, redraw = (
        [t.response_ids for t in engine.generate(prompt, sampling).trajectories] for _ in range(2)
    )
    assert len(first) == len(redraw) == 4
    assert all(len(t) == 12 for t in first + redraw)  # no stop token: full-length responses
    assert not set(map(tuple, first)) & set(map(tuple, redraw))


def test_the_async_rollout_group_seeds_as_the_colocated_engine():
    sampling = SamplingConfig(n=N, seed=RUN_SEED, max_new_tokens=1)
    prompts = [[7, k] for k in range(PROMPTS)]
    drawn = []
    for e in range(4):  # 4 engines of the rollout group, each its slice of the prompts
        lo, hi = engine_slice(PROMPTS, 4, e)
        engine = _Recording()
        generate_versioned(engine, prompts[lo:hi], sampling, rollout=2, first_prompt=lo, version=0)
        drawn += sample_seeds(engine.seeds[0], N)
    assert drawn == _step(2, engines=1)
