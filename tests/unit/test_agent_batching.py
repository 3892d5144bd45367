"""The endpoint's batching generator (megarl.agents.generation.EngineGenerator, issue 47's
continuous rollout): concurrent requests go to the engine together, and each gets what it would
have got alone; every caller is answered, an engine error reaches every request of its call, and
more callers than a call holds take turns without a deadlock."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence

import openai
import pytest
from transformers import AutoTokenizer

from megarl.agents.endpoint import AgentEndpoint
from megarl.agents.generation import EngineGenerator
from megarl.agents.loading import Agent
from megarl.agents.runner import AgentLimits, run_agents
from megarl.agents.turns import TurnSettings
from megarl.rollout.engine_calls import EngineCall, EngineFailed, Sampled
from megarl.rollout.hf_rollout import HFRollout
from megarl.rollout.rollout_types import RolloutOutput, SamplingConfig
from tests.assets import tiny_char_llama_dir

pytestmark = pytest.mark.unit

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=4)
JOIN_S = 60.0  # a thread not done by then is stuck: the test fails instead of hanging


def _in_threads(fns: Sequence[Callable[[], object]]) -> list[object]:
    """Each of ``fns`` in a thread of its own, started together; their results (or exceptions)."""
    start = threading.Barrier(len(fns))
    results: list[object] = [None] * len(fns)

    def run(k: int) -> None:
        start.wait()
        try:
            results[k] = fns[k]()
        except Exception as e:
            results[k] = e

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a caller was never answered"
    return results


class Echo:
    """An engine that answers each request with its seed and its token limit, after ``delay_s``,
    recording each call's size; it raises on the calls numbered in ``fail_calls``."""

    def __init__(self, delay_s: float = 0.01, fail_calls: Sequence[int] = ()) -> None:
        self.delay_s = delay_s
        self.fail_calls = set(fail_calls)
        self.sizes: list[int] = []

    def generate(self, prompts, sampling, seed_offset=0, *, seeds=None, max_new_tokens=None):
        assert sampling.n == 1 and seeds is not None and max_new_tokens is not None
        call = len(self.sizes)
        self.sizes.append(len(prompts))
        time.sleep(self.delay_s)
        if call in self.fail_calls:
            raise ValueError("out of KV cache")
        k = range(len(prompts))
        ids = [[int(seeds[i]), int(max_new_tokens[i])] for i in k]
        return RolloutOutput(list(k), ids, [[-1.0, -2.0] for _ in k], ["length" for _ in k])


# -- the real HF engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> HFRollout:
    return HFRollout(tiny_char_llama_dir())


def test_batched_requests_get_what_each_gets_alone_on_the_hf_engine(engine):
    rng = random.Random(0)
    requests = [
        ([rng.randrange(3, 60) for _ in range(rng.randrange(2, 30))], rng.randrange(1, 13), 100 + k)
        for k in range(8)
    ]
    alone = EngineGenerator(engine, SAMPLING, max_batch=1, window_s=0)
    expected = [alone.sample(*r) for r in requests]
    assert alone.calls == alone.requests == len(requests)
    # a wide window: the callers started together share calls
    batching = EngineGenerator(engine, SAMPLING, window_s=0.2)
    got = _in_threads([lambda r=r: batching.sample(*r) for r in requests])
    assert batching.requests == len(requests) and batching.calls < len(requests)
    for want, have in zip(expected, got, strict=True):
        assert isinstance(have, Sampled)
        assert (have.ids, have.finish) == (want.ids, want.finish)
        # the HF engine generates each request of a call on its own, unpadded: the same floats
        assert have.logprobs == pytest.approx(want.logprobs, rel=0, abs=0)


# -- the queue -----------------------------------------------------------------------------------
def test_requests_from_many_threads_are_all_answered_in_calls_of_at_most_max_batch():
    engine = Echo()
    announced: list[EngineCall] = []
    generator = EngineGenerator(engine, SAMPLING, announced.append, max_batch=4, window_s=0.01)
    got = _in_threads([lambda k=k: generator.sample([1, k], 1 + k % 5, seed=k) for k in range(32)])
    for k, out in enumerate(got):
        assert isinstance(out, Sampled) and out.ids == [k, 1 + k % 5], out
    assert sum(engine.sizes) == 32 and max(engine.sizes) <= 4 and len(engine.sizes) >= 8
    assert len(engine.sizes) < 32  # they did share calls
    # each call announced (for the engine's other ranks) with exactly its requests
    assert [len(c.requests) for c in announced] == engine.sizes
    assert sorted(r.seed for c in announced for r in c.requests) == list(range(32))


def test_an_engine_error_reaches_every_request_of_its_call_and_the_next_call_works():
    engine = Echo(fail_calls=[0])
    generator = EngineGenerator(engine, SAMPLING, window_s=0.2)
    got = _in_threads([lambda k=k: generator.sample([k], 2, seed=k) for k in range(6)])
    assert engine.sizes == [6]  # one call held them all
    for out in got:
        assert isinstance(out, EngineFailed) and "ValueError: out of KV cache" in str(out)
        assert isinstance(out.__cause__, ValueError)
    assert generator.sample([1], 3, seed=9).ids == [9, 3]  # the engine is free again


def test_a_failed_announcement_fails_the_call_without_making_it():
    engine = Echo()

    def announce(call: EngineCall) -> None:
        raise ConnectionError("rank 1 is gone")

    generator = EngineGenerator(engine, SAMPLING, announce, window_s=0)
    with pytest.raises(EngineFailed, match="ConnectionError: rank 1 is gone"):
        generator.sample([1], 2, seed=1)
    assert engine.sizes == []


def test_max_batch_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        EngineGenerator(Echo(), SAMPLING, max_batch=0)


def chatty_agent(row: dict, base_url: str, model: str) -> float:
    """Three requests, a short random pause (its 'tool') after each."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    pause = random.Random(row["k"])
    messages: list[dict] = [{"role": "user", "content": f"go {row['k']}"}]
    for _ in range(3):
        reply = client.chat.completions.create(model=model, messages=messages)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        time.sleep(pause.uniform(0, 0.02))
        messages.append({"role": "user", "content": "again"})
    return 1.0


def test_an_agent_pool_larger_than_the_batch_runs_every_agent_to_the_end():
    tokenizer = AutoTokenizer.from_pretrained(tiny_char_llama_dir())

    class Replying(Echo):
        def generate(self, prompts, sampling, seed_offset=0, *, seeds=None, max_new_tokens=None):
            out = super().generate(prompts, sampling, seeds=seeds, max_new_tokens=max_new_tokens)
            stop = [*tokenizer("ok", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
            out.token_ids = [list(stop) for _ in prompts]
            out.logprobs = [[-0.5] * len(stop) for _ in prompts]
            out.finish_reasons = ["stop" for _ in prompts]
            return out

    engine = Replying(delay_s=0.005)
    generator = EngineGenerator(engine, SAMPLING, max_batch=3)
    settings = TurnSettings(model="policy", seed=1, max_turn_tokens=8, max_context_tokens=512)
    with AgentEndpoint(generator, tokenizer, settings) as endpoint:
        batch = run_agents(
            Agent(chatty_agent, "chatty_agent", False),
            endpoint,
            [(k, {"k": k}) for k in range(16)],
            AgentLimits(concurrency=16, timeout_s=JOIN_S),
        )
    errors = [s.error for s in batch.samples if s.failed]
    assert not errors, errors[0]
    assert all(s.requests == 3 and s.segments[-1].turns == 3 for s in batch.samples)
    assert sum(engine.sizes) == 48 and max(engine.sizes) <= 3
    assert generator.requests == 48 and generator.calls == len(engine.sizes)
