"""Routing replay (actor.router_replay) through trajectories of several model turns: a multi-turn
environment's (rollout.env) and an agent's (rollout.agent) on the HF engine. Each turn's engine
call records its context's and its new tokens' experts; the trajectory keeps, per id, the first
call's record that routed it, so the environment's ids and each turn's last id come from the next
turn's prefill. The trajectory's routes must equal a teacher-forced transformers forward of the
whole trajectory (up to a rare near-tie), with every id recorded but the last, which nothing
read."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoTokenizer

from megarl.envs import ChatDeltas, Environment, Step, ToolPool
from megarl.envs.runner import EnvRunner
from megarl.envs.trajectory import Trajectory, merged_routes, step_routes
from megarl.hybrid_engine.hf_rollout import HFRollout
from megarl.hybrid_engine.multi_turn import TurnLimits, run_trajectories
from megarl.hybrid_engine.rollout_split import SampleStart, rank_output
from megarl.hybrid_engine.rollout_types import EngineConfig, SamplingConfig
from megarl.hybrid_engine.trajectory_source import EngineJob
from tests.assets import tiny_char_qwen3_moe_dir
from tests.distributed.router_replay_workers import natural_routes
from tests.unit.test_agent_trajectories import agent_source

pytestmark = pytest.mark.unit


class Ask(Environment):
    """Three model turns, a short follow-up question after each of the first two."""

    def __init__(self) -> None:
        self.seen = 0

    def reset(self, row):
        return [{"role": "user", "content": f"go {row['k']}"}]

    def step(self, messages):
        self.seen += 1
        if self.seen >= 3:
            return Step(done=True, reward=1.0)
        return Step(messages=[{"role": "user", "content": f"more {self.seen}?"}])


@pytest.fixture(scope="module")
def engine() -> HFRollout:
    return HFRollout(tiny_char_qwen3_moe_dir(), config=EngineConfig(record_routes=True))


def assert_routes_are_the_full_forwards(engine: HFRollout, t: Trajectory) -> int:
    """``t``'s routes against transformers' routing of its whole sequence read at once; how many
    model, environment and prompt ids they cover."""
    ids = t.prompt_ids + t.response_ids
    assert t.routes is not None and t.routes.dtype == torch.int16
    assert t.routes.shape[0] == len(ids)
    assert bool((t.routes[-1] == -1).all())  # the last id: nothing read it
    assert bool((t.routes[:-1] >= 0).all())  # every other id, the environment's included
    full = natural_routes(engine.model, torch.tensor([ids]))[0]
    mine = t.routes[:-1].long().sort(dim=-1).values
    theirs = full[:-1].long().sort(dim=-1).values
    differ = int((mine != theirs).any(dim=-1).sum())
    # decode and a whole-sequence forward round differently: a near-tie may flip once; a record
    # off by an id, a layer or a turn differs on about half of them
    assert differ <= 1, (differ, mine.shape[0] * mine.shape[1])
    return len(ids)


def test_a_multi_turn_trajectorys_routes_are_its_engine_calls_routing(engine):
    tok = AutoTokenizer.from_pretrained(tiny_char_qwen3_moe_dir())
    runner = EnvRunner(
        Ask, {}, ChatDeltas(tok), ToolPool(1, 5.0), 7, [tok.eos_token_id], max_prompt_tokens=200
    )
    starts = [SampleStart(sample=s, row={"k": s}, fallback_prompt=[1]) for s in range(2)]
    sampling = SamplingConfig(temperature=1.0, n=2, seed=3)  # turn 1: one request, 2 samples
    limits = TurnLimits(max_turns=3, max_response_tokens=200, max_turn_tokens=6)
    trajectories = run_trajectories(
        engine, starts, runner, sampling, limits, rollout_index=1, pad_id=0
    )
    runner.close()
    covered = 0
    for t in trajectories:
        assert t.turns == 3 and t.env_tokens > 0, (t.turns, t.finish)
        covered += assert_routes_are_the_full_forwards(engine, t)
    assert covered > 100
    # a trainer rank's share: each trajectory's routes in the engine output
    ours, output = rank_output(trajectories, 0, 1, 2)
    assert [r is t.routes for r, t in zip(output.routes, ours, strict=True)] == [True, True]


def test_routes_of_a_trajectory_no_call_routed_are_unrecorded():
    routed = Trajectory(sample=0, prompt_ids=[1, 2])
    routed.add_model_turn([3], [-0.1], torch.tensor([[[0, 1]], [[2, 3]], [[-1, -1]]]))
    failed = Trajectory(sample=1, prompt_ids=[4, 5, 6])
    failed.add_env_tokens([0])  # a failed reset: one masked id
    filled = step_routes([failed, routed], [failed, routed])
    assert filled[0].shape == (4, 1, 2) and bool((filled[0] == -1).all())
    assert filled[1] is routed.routes
    assert step_routes([failed], [failed]) == []  # nothing recorded in the step
    # a later call keeps what earlier calls recorded and fills what they did not
    later = torch.tensor([[[5, 5]], [[6, 6]], [[7, 7]], [[8, 8]], [[-1, -1]]])
    merged = merged_routes(routed.routes, later, 5)
    assert merged[:, 0].tolist() == [[0, 1], [2, 3], [7, 7], [8, 8], [-1, -1]]
    with pytest.raises(ValueError, match="recorded 5 ids' experts for a turn that leaves"):
        merged_routes(routed.routes, later, 6)


def chatting_agent(row: dict, base_url: str, model: str) -> float:
    """Drops its first exchange (a segment that is not trained), then continues the second
    twice (the trained segment: three model turns)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    messages: list[dict] = [{"role": "user", "content": f"hello {row['k']}"}]
    for k in range(3):
        reply = client.chat.completions.create(model=model, messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": f"and {k}?"}]
    return 0.5


def test_an_agents_trained_segment_carries_its_engine_calls_routing(engine):
    tok = AutoTokenizer.from_pretrained(tiny_char_qwen3_moe_dir())
    sampling = SamplingConfig(temperature=1.0, n=1, seed=5, max_new_tokens=6)
    source = agent_source(chatting_agent, tok, sampling, max_context_tokens=400, timeout_s=120)
    starts = [SampleStart(sample=s, row={"k": s}, fallback_prompt=[1]) for s in (0, 1)]
    part = source.run(EngineJob(engine, starts, 0, leader=True, share=lambda v: v))
    assert part is not None
    for t in part.trajectories:
        assert t.turns == 3 and t.env_tokens > 0, t.turns
        assert_routes_are_the_full_forwards(engine, t)
