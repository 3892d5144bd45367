"""Continuous batching step by step (megarl.rollout.step_loop.StepLoop, issue 47): a request
joins a running batch at the engine's next step and finishes before a longer request that was
already running (the call-by-call generator, the planted case, makes it wait for the whole call);
the engine's other rank adds the same requests and runs the same steps; a failed step fails every
request waiting, running or submitted later; the agents' endpoint picks the step loop where the
engine has one. Real vLLM: tests/distributed/test_partial_rollout.py."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megarl.agents.generation import EngineGenerator, StepGenerator, open_generator
from megarl.rollout.engine_calls import (
    EngineCall,
    EngineFailed,
    EngineStep,
    Request,
    Sampled,
    Steps,
    follow_requests,
)
from megarl.rollout.rollout_types import RolloutOutput, SamplingConfig
from megarl.rollout.step_loop import StepLoop

pytestmark = pytest.mark.unit

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=2)
JOIN_S = 30.0


def _answer(request: Request) -> Sampled:
    """A request's answer: one token per step up to its limit (the seed, then counting up)."""
    ids = [request.seed + k for k in range(request.max_new_tokens)]
    return Sampled(ids, [-0.5] * len(ids), "length")


def one_token_each(running: dict[str, list]) -> list[tuple[str, Sampled]]:
    """One step of a scripted engine: every running request (``key: [tokens left, answer]``)
    takes a token; those with none left finish (and leave ``running``)."""
    done = []
    for key, entry in list(running.items()):
        entry[0] -= 1
        if entry[0] <= 0:
            done.append((key, entry[1]))
            del running[key]
    return done


@dataclass
class Stepping:
    """A :class:`Steps` engine: a request is one token a step and ends at its token limit.
    Records every step (the keys added before it, the keys it finished); ``generate`` answers a
    whole call at once (the call-by-call driver's engine). Each step takes ``step_s``; the step
    numbered ``fail_at`` raises."""

    step_s: float = 0.005
    fail_at: int | None = None
    steps: list[tuple[list[str], list[str]]] = field(default_factory=list)
    running: dict[str, list] = field(default_factory=dict)
    stepped: threading.Event = field(default_factory=threading.Event)
    _added: list[str] = field(default_factory=list)

    def add_requests(self, requests, sampling) -> None:
        assert sampling.n == 1
        for key, request in requests:
            self.running[key] = [request.max_new_tokens, _answer(request)]
            self._added.append(key)

    def step(self) -> list[tuple[str, Sampled]]:
        if self.fail_at is not None and len(self.steps) == self.fail_at:
            raise ValueError("out of KV cache")
        time.sleep(self.step_s)
        done = one_token_each(self.running)
        self.steps.append((self._added, [key for key, _ in done]))
        self._added = []
        self.stepped.set()
        return done

    def generate(self, prompts, sampling, seed_offset=0, *, seeds=None, max_new_tokens=None):
        assert seeds is not None and max_new_tokens is not None
        time.sleep(self.step_s * max(max_new_tokens))  # one step per token of the longest
        answers = [
            _answer(Request(list(p), b, s))
            for p, b, s in zip(prompts, max_new_tokens, seeds, strict=True)
        ]
        k = list(range(len(prompts)))
        return RolloutOutput(
            k, [a.ids for a in answers], [a.logprobs for a in answers], ["length" for _ in k]
        )


def _running(loop: StepLoop) -> threading.Thread:
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    return thread


def test_a_stepping_engine_is_recognised():
    assert isinstance(Stepping(), Steps)
    assert not isinstance(object(), Steps)


def test_a_request_joins_the_running_batch_at_the_next_step():
    engine = Stepping()
    loop = StepLoop(engine, SAMPLING, window_s=0)
    thread = _running(loop)
    long = loop.submit(Request([1, 2], 40, seed=100))
    engine.stepped.wait(JOIN_S)  # the long request is running
    short = loop.submit(Request([3], 3, seed=500))
    assert short.result(JOIN_S) == _answer(Request([3], 3, 500))
    assert not long.done()  # the short one finished while the long one ran on
    assert long.result(JOIN_S) == _answer(Request([1, 2], 40, 100))
    loop.close()
    thread.join(JOIN_S)
    assert not thread.is_alive()
    added = [k for keys, _ in engine.steps for k in keys]
    assert len(added) == 2 and engine.steps[0][0] == [added[0]]
    joined = next(n for n, (keys, _) in enumerate(engine.steps) if added[1] in keys)
    finished = next(n for n, (_, keys) in enumerate(engine.steps) if added[1] in keys)
    assert joined >= 1 and finished == joined + 2  # its 3 tokens in 3 steps, from where it joined
    assert len(engine.steps) == 40 and loop.steps == 40 and loop.requests == 2
    assert loop.busy_s > 0


def test_by_whole_calls_the_late_request_waits_for_the_running_call():
    """The planted case: the call-by-call generator runs the long request's call to its end
    before the short request's call, so the short one finishes after it."""
    engine = Stepping()
    generator = EngineGenerator(engine, SAMPLING, window_s=0)
    finished: list[str] = []

    def ask(name: str, request: Request) -> None:
        generator.sample(request.prompt_ids, request.max_new_tokens, request.seed)
        finished.append(name)

    first = threading.Thread(target=ask, args=("long", Request([1, 2], 40, 100)))
    first.start()
    time.sleep(engine.step_s * 5)
    ask("short", Request([3], 3, 500))
    first.join(JOIN_S)
    assert finished == ["long", "short"]


class ThreadShare:
    """The engine's two ranks in two threads: what the first announces reaches the other."""

    def __init__(self) -> None:
        self.sent: queue.Queue = queue.Queue()

    def announce(self, message: EngineStep | EngineCall | None) -> None:
        self.sent.put(message)

    def receive(self) -> EngineStep | EngineCall | None:
        return self.sent.get(timeout=JOIN_S)


def test_the_engines_other_rank_adds_the_same_requests_and_runs_the_same_steps():
    first, other, share = Stepping(step_s=0.002), Stepping(step_s=0), ThreadShare()
    made: list[int] = []
    follower = threading.Thread(
        target=lambda: made.append(follow_requests(other, SAMPLING, share.receive)), daemon=True
    )
    follower.start()
    loop = StepLoop(first, SAMPLING, share.announce, window_s=0)
    thread = _running(loop)
    futures = []
    for k in range(6):  # requests arriving while others run
        futures.append(loop.submit(Request([k], 2 + 3 * k, seed=10 * k)))
        time.sleep(0.004)
    results = [f.result(JOIN_S) for f in futures]
    loop.close()
    thread.join(JOIN_S)
    share.announce(None)  # the end
    follower.join(JOIN_S)
    assert results == [_answer(Request([k], 2 + 3 * k, 10 * k)) for k in range(6)]
    assert other.steps == first.steps and made == [len(first.steps)]
    assert not other.running


def test_a_failed_step_fails_every_request_waiting_running_or_later():
    engine = Stepping(fail_at=3)
    loop = StepLoop(engine, SAMPLING, window_s=0)
    thread = _running(loop)
    running = loop.submit(Request([1], 30, seed=1))
    engine.stepped.wait(JOIN_S)
    late = loop.submit(Request([2], 2, seed=2))
    thread.join(JOIN_S)  # the loop ends at the failed step
    assert not thread.is_alive()
    for future in (running, late, loop.submit(Request([3], 1, seed=3))):
        with pytest.raises(EngineFailed, match="ValueError: out of KV cache"):
            future.result(JOIN_S)


def test_a_closed_loop_refuses_requests_and_ends_when_idle():
    loop = StepLoop(Stepping(), SAMPLING)
    loop.close()
    thread = _running(loop)
    thread.join(JOIN_S)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        loop.submit(Request([1], 1, seed=1))


class CallsOnly:
    def generate(self, *args, **kwargs):
        raise AssertionError("not called")


def test_a_rank_without_a_step_loop_refuses_to_follow_steps():
    with pytest.raises(TypeError, match="every rank of an engine must run the same backend"):
        EngineStep((("k", Request([1], 1, 1)),)).apply(CallsOnly(), SAMPLING)


def test_the_endpoint_drives_an_engine_step_by_step_where_it_can():
    assert isinstance(open_generator(CallsOnly(), SAMPLING), EngineGenerator)
    engine = Stepping()
    with open_generator(engine, SAMPLING) as generator:
        assert isinstance(generator, StepGenerator)
        answers: dict[int, Sampled] = {}
        threads = [
            threading.Thread(
                target=lambda k=k: answers.__setitem__(k, generator.sample([k], 1 + k, 7 * k))
            )
            for k in range(5)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
    assert answers == {k: _answer(Request([k], 1 + k, 7 * k)) for k in range(5)}
    assert not generator._thread.is_alive()  # the with block's end stopped the engine's loop


def _openmp_threads() -> int:
    """This thread's OpenMP count, from torch's OpenMP library (other packages load their own)."""
    import ctypes

    import torch

    library = next(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*"))
    return ctypes.CDLL(str(library)).omp_get_max_threads()


def test_a_thread_that_drives_the_engine_gets_the_ranks_thread_count():
    """vLLM's CPU attention refuses a step planned with another OpenMP thread count than it runs
    with, and a new thread starts at OpenMP's default."""
    import torch

    from megarl.rollout.engine_calls import engine_thread_setup

    # torch's own setter: a vLLM engine started in this process replaced torch.set_num_threads
    before = torch.get_num_threads()
    torch._C.set_num_threads(3)  # neither OpenMP's default here (the cores, OMP_NUM_THREADS) nor 1
    try:
        setup = engine_thread_setup()
        counts: list[int] = []

        def in_a_new_thread() -> None:
            counts.append(_openmp_threads())
            setup()
            counts.append(_openmp_threads())

        thread = threading.Thread(target=in_a_new_thread)
        thread.start()
        thread.join(JOIN_S)
    finally:
        torch._C.set_num_threads(before)
    assert counts[0] != 3 and counts[1] == 3
