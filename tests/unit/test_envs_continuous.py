"""The continuous turn loop (rollout.environment.turn_loop=continuous) against the lock-step one, with a
scripted engine whose answer to a request depends only on the request: the same trajectories,
token for token, in every case the lock-step loop's tests cover (turns, budgets, limits, failed
resets and steps, shared first turns); a trajectory whose environment is slow does not hold the
others (they end while it waits, which deadlocks the lock-step loop until its wait times out);
an engine spread over two ranks makes every call on both; a failed engine call ends the rollout
with the engine's error. The equality and two-rank cases run on an engine with a step loop too
(:class:`ScriptedSteps`: the loop drives it step by step, megarl.rollout.step_loop)."""

from __future__ import annotations

import queue
import threading
from dataclasses import asdict, replace
from typing import ClassVar

import pytest
from transformers import AutoTokenizer

from megarl.envs import ChatDeltas, Environment, Step, ToolPool
from megarl.envs.runner import EnvRunner
from megarl.rollout.continuous import run_continuous
from megarl.rollout.engine_calls import EngineFailed, Sampled
from megarl.rollout.env_source import TURN_LOOPS
from megarl.rollout.multi_turn import TurnLimits
from megarl.rollout.rollout_split import SampleStart
from megarl.rollout.rollout_types import SamplingConfig
from tests.assets import qwen25_tokenizer_dir
from tests.unit.test_envs_turn_loop import Echo, Quiz, ScriptedEngine
from tests.unit.test_step_loop import one_token_each

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(qwen25_tokenizer_dir())


def _identity(value, /):
    return value


class ScriptedSteps(ScriptedEngine):
    """The scripted engine with a step loop (megarl.rollout.engine_calls.Steps): a request's
    answer, what ``generate`` gives it alone, comes out after as many steps as it has tokens."""

    def __init__(self, tokenizer, words: int = 3):
        super().__init__(tokenizer, words)
        self.running: dict[str, list] = {}

    def add_requests(self, requests, sampling):
        for key, r in requests:
            out = self.generate(
                [r.prompt_ids],
                replace(sampling, n=1),
                seeds=[r.seed],
                max_new_tokens=[r.max_new_tokens],
            )
            answer = Sampled(out.token_ids[0], out.logprobs[0], out.finish_reasons[0])
            self.running[key] = [len(answer.ids), answer]

    def step(self):
        return one_token_each(self.running)


ENGINES = {"calls": ScriptedEngine, "steps": ScriptedSteps}


def _rollout(
    tok, loop, env, samples, sampling, limits, words=3, rows=None, engine="calls", **env_kwargs
):
    engine = ENGINES[engine](tok, words=words)
    runner = EnvRunner(
        env, env_kwargs, ChatDeltas(tok), ToolPool(4, 5.0), 7, [tok.eos_token_id], 200
    )
    n = max(1, sampling.n)
    rows = rows or [{"id": s // n, "prompt": f"question {s // n}"} for s in samples]
    starts = [
        SampleStart(s, row, tok("q")["input_ids"]) for s, row in zip(samples, rows, strict=True)
    ]
    trajs = TURN_LOOPS[loop](
        engine, starts, runner, sampling, limits, rollout_index=5, pad_id=0, share=_identity
    )
    runner.close()
    return trajs, engine


def _fields(t) -> dict:
    d = asdict(t)
    d.pop("routes")
    return d


CASES = {  # name: (environment, samples, sampling, limits, words, env kwargs)
    "two turns": (Quiz, range(4), 1, TurnLimits(4, 200, 50), 3, {"rounds": 2}),
    "out of turns": (Quiz, range(3), 1, TurnLimits(2, 500, 50), 3, {"rounds": 5}),
    "budget shrinks": (Quiz, range(2), 1, TurnLimits(9, 30, 4), 3, {"rounds": 9}),
    "env eats budget": (Quiz, range(2), 1, TurnLimits(3, 30, 8), 3, {"rounds": 9}),
    "reset fails": (
        Quiz,
        range(3),
        1,
        TurnLimits(4, 200, 50),
        3,
        {"rounds": 3, "fail_on": "reset"},
    ),
    "step fails": (Quiz, range(2), 1, TurnLimits(4, 200, 50), 3, {"rounds": 3, "fail_on": "step"}),
    "shared first turn": (Echo, range(4, 16), 4, TurnLimits(3, 6, 6), 1, {}),
    "shared, cut": (Echo, range(4), 4, TurnLimits(3, 6, 6), 9, {}),
    "per-sample prompts, n=4": (Quiz, range(4, 12), 4, TurnLimits(3, 200, 6), 1, {"rounds": 3}),
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_continuous_trajectories_equal_the_lockstep_ones(tok, case, engine):
    env, samples, n, limits, words, kwargs = CASES[case]
    sampling = SamplingConfig(temperature=1.0, n=n, seed=11, max_new_tokens=6)
    lock, lock_engine = _rollout(tok, "lockstep", env, samples, sampling, limits, words, **kwargs)
    cont, cont_engine = _rollout(
        tok, "continuous", env, samples, sampling, limits, words, engine=engine, **kwargs
    )
    assert [_fields(t) for t in cont] == [_fields(t) for t in lock]
    assert all(t.done for t in cont)
    # the same requests reached the engine (seeds and budgets), whatever shared their calls
    lock_requests = sorted(
        (s, b)
        for (_, _, budgets), (_, seeds) in zip(lock_engine.calls, lock_engine.seeds, strict=True)
        for s, b in zip(seeds, budgets, strict=True)
    )
    cont_requests = sorted(
        (s, b)
        for (_, _, budgets), (_, seeds) in zip(cont_engine.calls, cont_engine.seeds, strict=True)
        for s, b in zip(seeds, budgets, strict=True)
    )
    assert cont_requests == lock_requests
    # the first turn is one call for every sample, as the lock-step loop's
    assert cont_engine.calls[0] == lock_engine.calls[0]


class WaitsForTheOthers(Environment):
    """Three model turns. Sample 0's first step waits until every other sample has ended (or
    ``wait_s`` passed); the others answer at once. Records whether sample 0's wait was met."""

    others_done = threading.Event()
    others_left: ClassVar[list[int]] = []
    met: ClassVar[list[bool]] = []
    wait_s = 5.0

    def reset(self, row):
        self.sample, self.steps = row["id"], 0
        return [{"role": "user", "content": f"question {row['id']}"}]

    def step(self, messages):
        self.steps += 1
        if self.sample == 0 and self.steps == 1:
            WaitsForTheOthers.met.append(WaitsForTheOthers.others_done.wait(self.wait_s))
        if self.steps == 3:
            if self.sample != 0:
                WaitsForTheOthers.others_left.pop()
                if not WaitsForTheOthers.others_left:
                    WaitsForTheOthers.others_done.set()
            return Step(done=True, reward=1.0)
        return Step(messages=[{"role": "user", "content": "go on"}])


@pytest.mark.parametrize(
    ("loop", "wait_s", "met"), [("continuous", 5.0, True), ("lockstep", 0.5, False)]
)
def test_a_slow_environment_does_not_hold_the_others(tok, loop, wait_s, met):
    """Continuous: samples 1-5 take their three turns while sample 0's environment waits for them,
    so its wait is met. Lock-step (the planted case): every turn waits for sample 0's step, so the
    others cannot end and the wait runs out."""
    WaitsForTheOthers.others_done = threading.Event()
    WaitsForTheOthers.others_left = list(range(5))
    WaitsForTheOthers.met = []
    WaitsForTheOthers.wait_s = wait_s
    sampling = SamplingConfig(temperature=1.0, n=1, seed=3, max_new_tokens=6)
    trajs, engine = _rollout(
        tok, loop, WaitsForTheOthers, range(6), sampling, TurnLimits(3, 200, 6), words=1,
        rows=[{"id": s, "prompt": "q"} for s in range(6)],
    )  # fmt: skip
    assert WaitsForTheOthers.met == [met]
    assert all(t.finish == "stop" and t.turns == 3 for t in trajs)
    if loop == "continuous":  # sample 0's last two turns came after the others had ended
        assert [n for n, *_ in engine.calls][-2:] == [1, 1]


class ThreadShare:
    """Two ranks of one engine in two threads: the first rank's value reaches the other."""

    def __init__(self) -> None:
        self.sent: queue.Queue = queue.Queue()

    def first(self, value, /):
        self.sent.put(value)
        return value

    def other(self, value, /):
        assert value is None
        return self.sent.get(timeout=30)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_engines_other_rank_makes_every_call(tok, engine):
    sampling = SamplingConfig(temperature=1.0, n=2, seed=5, max_new_tokens=6)
    limits = TurnLimits(3, 200, 6)
    rows = [{"id": s // 2, "prompt": f"question {s // 2}"} for s in range(6)]
    starts = [SampleStart(s, row, tok("q")["input_ids"]) for s, row in enumerate(rows)]
    share = ThreadShare()
    engines = [ENGINES[engine](tok, words=1), ENGINES[engine](tok, words=1)]
    runner = EnvRunner(
        Quiz, {"rounds": 3}, ChatDeltas(tok), ToolPool(4, 5.0), 7, [tok.eos_token_id], 200
    )
    out: dict[str, object] = {}

    def other() -> None:
        out["other"] = run_continuous(
            engines[1], starts, None, sampling, limits, rollout_index=2, pad_id=0, share=share.other
        )

    thread = threading.Thread(target=other)
    thread.start()
    trajs = run_continuous(
        engines[0], starts, runner, sampling, limits, rollout_index=2, pad_id=0, share=share.first
    )
    thread.join(30)
    assert not thread.is_alive() and out["other"] is None
    assert trajs is not None and all(t.turns == 3 for t in trajs)
    assert engines[1].calls == engines[0].calls and engines[1].seeds == engines[0].seeds
    assert len(engines[0].calls) >= 3


class FailsOnSecondCall(ScriptedEngine):
    def generate(self, prompts, sampling, seed_offset=0, *, seeds=None, max_new_tokens=None):
        if self.calls:
            raise RuntimeError("the engine broke")
        return super().generate(
            prompts, sampling, seed_offset, seeds=seeds, max_new_tokens=max_new_tokens
        )


def test_a_failed_engine_call_ends_the_rollout_with_its_error(tok):
    sampling = SamplingConfig(temperature=1.0, n=1, seed=3, max_new_tokens=6)
    runner = EnvRunner(
        Quiz, {"rounds": 3}, ChatDeltas(tok), ToolPool(4, 5.0), 7, [tok.eos_token_id], 200
    )
    starts = [SampleStart(s, {"id": s, "prompt": "q"}, []) for s in range(4)]
    with pytest.raises(EngineFailed, match="RuntimeError: the engine broke"):
        run_continuous(
            FailsOnSecondCall(tok), starts, runner, sampling, TurnLimits(3, 200, 6),
            rollout_index=0, pad_id=0, share=_identity,
        )  # fmt: skip
    runner.close()
