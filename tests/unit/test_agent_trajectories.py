"""How an agent's samples become the trajectories training trains on (megarl.agents.trajectories),
the step's agent metrics over engines, and the engine calls an engine's other ranks repeat
(megarl.agents.generation.follow_requests)."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from megarl.agents.generation import EngineGenerator
from megarl.agents.loading import Agent
from megarl.agents.runner import AgentBatch, AgentLimits, AgentSample, agent_metrics
from megarl.agents.trajectories import (
    UNTRAINED_TOKENS,
    AgentSource,
    agent_step_metrics,
    sample_trajectory,
)
from megarl.agents.turns import TurnSettings
from megarl.envs.trajectory import Trajectory
from megarl.rollout.engine_calls import EngineCall, Request, follow_requests
from megarl.rollout.rollout_split import SampleStart
from megarl.rollout.rollout_types import RolloutOutput, SamplingConfig
from megarl.rollout.seeds import sequence_seed
from megarl.rollout.trajectory_source import EngineJob, EngineTrajectories
from tests.assets import tiny_char_llama_dir

pytestmark = pytest.mark.unit

PAD = 0
START = SampleStart(sample=5, row={}, fallback_prompt=[7, 8])


def _segment(prompt: list[int], turns: list[list[int]]) -> Trajectory:
    t = Trajectory(sample=5, prompt_ids=prompt)
    for k, ids in enumerate(turns):
        if k:
            t.add_env_tokens([90 + k])
        t.add_model_turn(ids, [-0.5] * len(ids))
    t.end("stop")
    t.turn_rewards = [None] * t.turns
    return t


def test_a_sample_trains_its_last_segment_with_the_agents_reward():
    first, last = _segment([1], [[2, 3]]), _segment([4], [[5], [6, 7]])
    t = sample_trajectory(AgentSample(5, [first, last], reward=0.75), START, PAD)
    assert t is last and t.turn_rewards == [None, 0.75] and t.env_scored_outcome
    assert t.env_reward == 0.75 and t.finish == "stop"


def test_no_reward_leaves_the_score_to_the_rows_scorer():
    t = sample_trajectory(AgentSample(5, [_segment([4], [[5], [6]])], reward=None), START, PAD)
    assert t.turn_rewards == [None, None] and not t.env_scored_outcome


def test_a_failed_agent_scores_zero_and_counts_as_failed():
    seg = _segment([4], [[5]])
    failed = AgentSample(5, [seg], reward=0.0, outcome="timeout", error="late")
    t = sample_trajectory(failed, START, PAD)
    assert (t.finish, t.error) == ("error", "late")
    # without any request: the row's own prompt and one masked token that trains nothing
    silent = AgentSample(5, [], reward=0.0, outcome="no_requests", error="silent")
    t = sample_trajectory(silent, START, PAD)
    assert (t.sample, t.prompt_ids, t.response_ids, t.mask) == (5, [7, 8], [PAD], [0])
    assert (t.finish, t.error, t.turns) == ("error", "silent", 0)


def test_the_steps_agent_metrics_sum_the_engines():
    a = AgentBatch([AgentSample(0, [_segment([1], [[2]])], 1.0, requests=1)], {"ignored_params": 2})
    b = AgentBatch(
        [
            AgentSample(1, [_segment([1], [[2]]), _segment([1], [[3]])], None, requests=4),
            AgentSample(2, [], 0.0, outcome="timeout", requests=0),
        ]
    )
    parts = [
        EngineTrajectories([], 1.5, a.totals() | {UNTRAINED_TOKENS: 0.0}),
        EngineTrajectories([], 2.5, b.totals() | {UNTRAINED_TOKENS: 1.0}),
    ]
    m = agent_step_metrics(parts)
    assert m["agent/samples"] == 3 and m["agent/timeouts"] == 1 and m["agent/failures"] == 0
    assert m["agent/requests_mean"] == pytest.approx(5 / 3, abs=1e-12)
    assert m["agent/segments_mean"] == pytest.approx(1.0, abs=1e-12)
    assert m["agent/ignored_params"] == 2 and m[UNTRAINED_TOKENS] == 1 and m["agent/s"] == 2.5
    # one engine's metrics are its batch's own
    assert agent_metrics(a.totals(), 1.5) == {k: v.value for k, v in a.metrics().items()} | {
        "agent/s": 1.5
    }


class Recording:
    """An engine that records its calls and answers each request with its prompt's last id + 1."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], list[int], list[int]]] = []

    def generate(self, prompts, sampling, seed_offset=0, *, seeds=None, max_new_tokens=None):
        assert sampling.n == 1 and seeds is not None and max_new_tokens is not None
        self.calls.append(([list(p) for p in prompts], list(seeds), list(max_new_tokens)))
        k = range(len(prompts))
        return RolloutOutput(
            list(k), [[p[-1] + 1] for p in prompts], [[-0.25] for _ in k], ["stop" for _ in k]
        )


def test_the_other_ranks_make_each_announced_request_until_the_end():
    sampling = SamplingConfig(n=4, seed=3)
    first, other = Recording(), Recording()
    announced: list[EngineCall | None] = []
    generator = EngineGenerator(first, sampling, announce=announced.append)
    out = generator.sample([1, 2], 5, seed=11)
    generator.sample([1, 2, 3, 4], 2, seed=12)
    assert (out.ids, out.logprobs, out.finish) == ([3], [-0.25], "stop")
    announced.append(None)  # the end
    queue = iter(announced)
    assert follow_requests(other, sampling, lambda: next(queue)) == 2
    assert other.calls == first.calls == [([[1, 2]], [11], [5]), ([[1, 2, 3, 4]], [12], [2])]


# -- an engine's part through the endpoint: the first rank and a follower -----------------------
def editing_agent(row: dict, base_url: str, model: str) -> float:
    """Drops its first exchange (a new segment), then continues the second with a tool result."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    edited: list[dict] = [{"role": "user", "content": f"hello {row['k']}"}]
    second = client.chat.completions.create(model=model, messages=edited)
    edited += [second.choices[0].message.model_dump(exclude_none=True)]
    edited += [{"role": "tool", "content": "3"}]
    client.chat.completions.create(model=model, messages=edited)
    return 0.5


class Replying(Recording):
    """Answers every request with the same few tokens and the stop token."""

    def __init__(self, reply: list[int]) -> None:
        super().__init__()
        self.reply = reply

    def generate(self, prompts, sampling, seed_offset=0, *, seeds=None, max_new_tokens=None):
        super().generate(prompts, sampling, seeds=seeds, max_new_tokens=max_new_tokens)
        k = range(len(prompts))
        return RolloutOutput(
            list(k),
            [list(self.reply) for _ in k],
            [[-0.5] * len(self.reply) for _ in k],
            ["stop" for _ in k],
        )


def agent_source(
    fn, tokenizer, sampling: SamplingConfig, max_context_tokens: int, timeout_s: float = 60
) -> AgentSource:
    """The agent function ``fn``'s source: the run's seed and turn length those of
    ``sampling``, two agents at a time."""
    settings = TurnSettings(
        model="policy",
        seed=sampling.seed,
        max_turn_tokens=sampling.max_new_tokens,
        max_context_tokens=max_context_tokens,
    )
    limits = AgentLimits(concurrency=2, timeout_s=timeout_s)
    return AgentSource(Agent(fn, fn.__name__, False), tokenizer, settings, limits, sampling, PAD)


def test_an_engines_part_trains_each_samples_last_segment_and_its_followers_repeat_the_calls():
    tokenizer = AutoTokenizer.from_pretrained(tiny_char_llama_dir())
    reply = [*tokenizer("ok", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    sampling = SamplingConfig(n=2, seed=9, max_new_tokens=8)
    source = agent_source(editing_agent, tokenizer, sampling, max_context_tokens=256)
    starts = [SampleStart(sample=s, row={"k": s}, fallback_prompt=[1]) for s in (4, 5)]
    first = Replying(reply)
    announced: list[EngineCall | None] = []

    def share(value):
        announced.append(value)
        return value

    part = source.run(EngineJob(first, starts, 2, leader=True, share=share))
    assert part is not None and [t.sample for t in part.trajectories] == [4, 5]
    for t in part.trajectories:
        assert t.turns == 2 and t.turn_rewards == [None, 0.5] and t.finish == "stop"
        assert t.mask[: len(reply)] == [1] * len(reply) and t.env_tokens > 0  # turn, tool, turn
        assert "hello" in tokenizer.decode(t.prompt_ids)  # the edited conversation's rendering
    assert part.totals["agent/non_continuations"] == 2  # one split per sample
    assert part.totals[UNTRAINED_TOKENS] == 2 * len(reply)  # each first exchange's reply
    # every engine call announced first, the end last (the two agents' concurrent requests may
    # share a call: 3 to 6 calls for 6 requests); each request its own seeded stream
    assert announced[-1] is None and 3 <= len(announced) - 1 == len(first.calls) <= 6
    assert [c.requests for c in announced[:-1]] == [  # type: ignore[union-attr]
        tuple(Request(p, m, s) for p, s, m in zip(*call, strict=True)) for call in first.calls
    ]
    seeds = sorted(seed for _, call_seeds, _ in first.calls for seed in call_seeds)
    assert seeds == sorted(sequence_seed(9, 2, s, segment=k) for s in (4, 5) for k in range(3))
    # an engine's other rank makes the same calls, in the announced order, and returns nothing
    follower, queue = Replying(reply), iter(announced)
    assert (
        source.run(EngineJob(follower, starts, 2, leader=False, share=lambda _: next(queue)))
        is None
    )
    assert follower.calls == first.calls
