"""The environment API: loading ``rollout.env`` with clear errors, the checks of what ``reset``
and ``step`` return, and the tool environment's turns."""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path

import pytest
import yaml

from megarl.config import RunConfig
from megarl.config.moved_keys import MOVED_KEYS
from megarl.config_keys import prepare_layer
from megarl.envs import EnvContext, EnvError, Environment, Step, ToolEnvironment, ToolPool
from megarl.envs.base import bind_context, check_reset, check_step
from megarl.envs.loading import check_environment
from megarl.errors import ConfigError

pytestmark = pytest.mark.unit

ENV_FILE = """
from megarl.envs import Environment, Step

class Echo(Environment):
    def __init__(self, level: int = 1):
        self.level = level

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        return Step(done=True, reward=float(self.level))

class NotAnEnv:
    pass

class Half(Environment):
    def reset(self, row):
        return []
"""


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(ENV_FILE)
    return path


def test_rollout_env_loads_from_a_file_and_checks_its_kwargs(env_file, tmp_path):
    cls = check_environment(f"{env_file}:Echo", {"level": 3})
    assert cls(level=3).step([]).reward == 3.0
    assert check_environment("megarl.envs:ToolEnvironment", {"tools": ["calculator"]})
    cases = [
        (f"{tmp_path / 'missing.py'}:Echo", {}, "does not exist"),
        (f"{env_file}:Nope", {}, "has no attribute 'Nope'"),
        (f"{env_file}:NotAnEnv", {}, "not a subclass of megarl.envs.Environment"),
        (f"{env_file}:Half", {}, "does not implement ['step']"),
        (f"{env_file}:Echo", {"levle": 3}, "do not fit Echo.__init__"),
        ("no_such_module_xyz:Env", {}, "cannot import module"),
        ("Echo", {}, "is not an import path"),
    ]
    for spec, kwargs, message in cases:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            check_environment(spec, kwargs)


class Plain(Environment):
    def reset(self, row):
        return row


def test_reset_and_step_results_are_checked():
    env = Plain()
    assert check_reset(env, [{"role": "user", "content": "hi"}]) == [
        {"role": "user", "content": "hi"}
    ]
    bad_resets = [
        ("hello", "must return a list of chat messages"),
        ([], "returned no messages"),
        ([{"role": "user"}], "string 'role' and a string 'content'"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "ends with an assistant",
        ),
        (["hi"], "not a dict"),
    ]
    for value, message in bad_resets:
        with pytest.raises(EnvError, match=message):
            check_reset(env, value)
    assert check_step(env, Step(done=True, reward=1)).reward == 1.0
    bad_steps = [
        ({"messages": []}, "must return megarl.envs.Step"),
        (Step(messages=[{"role": "assistant", "content": "x"}]), "role 'assistant'"),
        (Step(messages=[{"role": "user", "content": "x"}], reward="1"), "must be a number"),
        (Step(messages=[{"role": "user", "content": "x"}], reward=float("nan")), "must be finite"),
        (Step(), "must give the messages the model answers next"),
        (Step(done="yes"), "must be True or False"),
        (Step(done=True, metrics={"calls": "two"}), "Step.metrics"),
    ]
    for value, message in bad_steps:
        with pytest.raises(EnvError, match=message):
            check_step(env, value)


def test_tool_environment_turns():
    env = ToolEnvironment(
        tools=["calculator"], system_prompt="Tools:{tools}\nCall as {call_format}"
    )
    pool = ToolPool(max_concurrency=2, timeout_s=5)
    bind_context(env, EnvContext(pool=pool, template_renders_tools=False))
    start = env.reset({"prompt": "What is 12 * 34?"})
    assert start[0]["role"] == "system" and '"name": "calculator"' in start[0]["content"]
    assert "<tool_call>" in start[0]["content"] and start[1]["content"] == "What is 12 * 34?"
    # a template that renders tools gets them through the template, not the system text
    bind_context(env, EnvContext(pool=pool, template_renders_tools=True))
    assert '"name": "calculator"' not in env.reset({"prompt": "q"})[0]["content"]
    assert env.tool_schemas()[0]["function"]["name"] == "calculator"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'
    step = asyncio.run(env.step([*start, {"role": "assistant", "content": call}]))
    assert step == check_step(env, step)
    assert step.messages == [{"role": "tool", "name": "calculator", "content": "408"}]
    assert not step.done and step.metrics["tool_calls"] == 1 and step.metrics["tool_errors"] == 0
    # a turn that calls a tool is never the answer: rewarded (0 without credits), so a trajectory
    # cut on it at rollout.environment.max_turns is not scored as if the call were its final answer
    assert step.reward == 0.0
    wrong = asyncio.run(env.step([{"role": "assistant", "content": "<tool_call>{x</tool_call>"}]))
    assert wrong.metrics["tool_errors"] == 1 and "not valid JSON" in wrong.messages[0]["content"]
    final = asyncio.run(env.step([{"role": "assistant", "content": "It is 408."}]))
    assert final.done and final.reward is None and final.messages == []
    demo = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    shaped = ToolEnvironment(tools=["calculator"], examples=demo, call_reward=0.2)
    bind_context(shaped, EnvContext(pool=pool, template_renders_tools=True))
    start = shaped.reset(
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]}
    )
    assert [m["role"] for m in start] == ["system", "user", "assistant", "user"]
    assert start[0]["content"].endswith("\n\nBe brief.") and start[1:3] == demo
    turn = [{"role": "assistant", "content": call}]
    assert asyncio.run(shaped.step(turn)).reward == 0.2  # the first good call earns the credit
    assert asyncio.run(shaped.step(turn)).reward == 0.0  # once per trajectory
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
    fresh = ToolEnvironment(tools=["calculator"], call_reward=0.2, attempt_reward=0.05)
    bind_context(fresh, EnvContext(pool=pool))
    assert asyncio.run(fresh.step([{"role": "assistant", "content": bad}])).reward == 0.05
    assert asyncio.run(fresh.step(turn)).reward == 0.0  # a credit per trajectory, the first
    with pytest.raises(ConfigError, match="unknown tool 'abacus'"):
        ToolEnvironment(tools=["abacus"])
    with pytest.raises(ConfigError, match="unknown tool-call parser"):
        ToolEnvironment(parser="xml")
    pool.close()


DOCS = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def _doc_blocks(lang: str) -> list[str]:
    text = DOCS.read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)


def test_the_guide_examples_run(tmp_path):
    """docs/environments.md: its environment plays as described, its tool has a schema and
    runs, and its YAML settings are settings of megarl's config."""
    env_code, tool_code = _doc_blocks("python")[:2]
    (tmp_path / "my_env.py").write_text(env_code)
    (tmp_path / "my_tools.py").write_text(tool_code)
    cls = check_environment(f"{tmp_path / 'my_env.py'}:GuessNumber", {"high": 50})
    env = cls(high=50)
    bind_context(env, EnvContext(seed=3, rng=random.Random(3)))
    messages = check_reset(env, env.reset({}))
    low, high, turns = 1, 50, 0
    while True:  # bisect with the environment's hints
        turns += 1
        guess = (low + high) // 2
        messages.append({"role": "assistant", "content": f"My guess is {guess}."})
        step = check_step(env, env.step(messages))
        if step.done:
            assert guess == env.secret and step.reward == pytest.approx(1 / turns)
            break
        hint = step.messages[0]["content"]
        low, high = (guess + 1, high) if hint == "Higher." else (low, guess - 1)
        messages += step.messages
    tool_env = ToolEnvironment(tools=["calculator", f"{tmp_path / 'my_tools.py'}:lookup_price"])
    bind_context(tool_env, EnvContext(pool=ToolPool(2, 5)))
    assert "quantity" in json.dumps(tool_env.tool_schemas())
    call = '<tool_call>{"name": "lookup_price", "arguments": {"item": "bread", "quantity": 2}}</tool_call>'
    assert (
        asyncio.run(tool_env.step([{"role": "assistant", "content": call}])).messages[0]["content"]
        == "4.50"
    )
    for block in _doc_blocks("yaml"):  # every key known, none of them one that has moved
        layer = {"rollout": yaml.safe_load(block)["rollout"]}
        moved = [old for old in MOVED_KEYS if old.split(".")[1] in layer["rollout"]]
        assert not moved and not prepare_layer(RunConfig, layer), (moved, layer)
