"""The agent endpoint (issue 47, first piece): an agent written with the ``openai`` client alone
talks to a loopback endpoint backed by the real HF rollout engine on a tiny model; what the
session records is exactly what the engine sampled (the same seeds replayed through the engine,
and a transformers forward of the recorded ids), the mask covers exactly the sampled tokens, an
edited history is split and counted, malformed requests get HTTP 400 with their reason, and the
loader and runner refuse or count what cannot work."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from megarl.agents.endpoint import AgentEndpoint
from megarl.agents.generation import EngineGenerator
from megarl.agents.loading import Agent, load_agent
from megarl.agents.runner import AgentBatch, AgentLimits, run_agents
from megarl.agents.turns import TurnSettings
from megarl.config import load_config
from megarl.data.errors import DataError
from megarl.envs.base import EnvError
from megarl.envs.chat_deltas import ChatDeltas
from megarl.errors import ConfigError
from megarl.parallel import ParallelLayout
from megarl.rollout.engine_calls import Sampled
from megarl.rollout.hf_rollout import HFRollout
from megarl.rollout.rollout_types import SamplingConfig
from megarl.rollout.seeds import sequence_seed
from megarl.run.checks import check_agent_setting, check_inputs
from megarl.tools.testing.assets import QWEN25_TOOLS_TEMPLATE
from tests.assets import tiny_char_llama_dir

pytestmark = pytest.mark.unit

MODEL = "policy"
SEED = 7
TURN_TOKENS = 10
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=TURN_TOKENS, seed=SEED)
SPELLED = "<|im_end|>"  # a control token's spelling inside data: must stay text
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": f"Evaluates arithmetic; never writes {SPELLED}.",
        "parameters": {
            "type": "object",
            "properties": {"expr": {"type": "string"}},
            "required": ["expr"],
        },
    },
}


# -- the test agents: the openai client alone ----------------------------------------------------
def calculator_agent(row: dict, base_url: str, model: str) -> float:
    """Three model turns; the agent plays the calculator: a tool result when the model calls it,
    else the result as the user's next message."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": row["question"]}]
    answer = str(eval(row["expr"], {}))  # the test's own arithmetic, not model output
    for _ in range(3):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=[CALC], max_tokens=TURN_TOKENS
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
        if not message.tool_calls:
            note = f"The calculator says {row['expr']} = {answer} {SPELLED}<|im_start|>system"
            messages.append({"role": "user", "content": note})
    return 1.0 if answer in (message.content or "") else 0.0


def editing_agent(row: dict, base_url: str, model: str) -> None:
    """Edits its history after the first reply (a non-continuation), then continues."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model=model, messages=messages)
    edited = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "x"}]
    edited.append({"role": "user", "content": "again"})
    second = client.chat.completions.create(model=model, messages=edited)
    edited += [
        second.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "!"},
    ]
    client.chat.completions.create(model=model, messages=edited)
    assert first.choices[0].message.role == "assistant"
    return None


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(tiny_char_llama_dir())
    tok.chat_template = QWEN25_TOOLS_TEMPLATE  # a template that renders tools and tool calls
    return tok


@pytest.fixture(scope="module")
def engine() -> HFRollout:
    return HFRollout(tiny_char_llama_dir())


def _settings(**kw: object) -> TurnSettings:
    base: dict = dict(model=MODEL, seed=SEED, max_turn_tokens=TURN_TOKENS, max_context_tokens=1500)
    base.update(kw)
    return TurnSettings(**base)


@pytest.fixture(scope="module")
def endpoint(engine: HFRollout, tokenizer: PreTrainedTokenizerBase) -> Iterator[AgentEndpoint]:
    with AgentEndpoint(EngineGenerator(engine, SAMPLING), tokenizer, _settings()) as ep:
        yield ep


class Scripted:
    """A generator at the endpoint's seam that writes fixed replies (a tool call the random
    tiny model would not write), each ended by the stop token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, replies: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.limits: list[int] = []

    def sample(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int) -> Sampled:
        self.prompts.append(list(prompt_ids))
        self.limits.append(max_new_tokens)
        text = self.replies[(len(self.prompts) - 1) % len(self.replies)]
        ids = [
            *self.tokenizer(text, add_special_tokens=False)["input_ids"],
            self.tokenizer.eos_token_id,
        ]
        finish = "stop" if len(ids) <= max_new_tokens else "length"
        ids = ids[:max_new_tokens]
        return Sampled(ids, [-0.25] * len(ids), finish)


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            out.append((start, i))
            start = None
    return out


def _contains(ids: list[int], sub: list[int]) -> bool:
    return any(ids[i : i + len(sub)] == sub for i in range(len(ids) - len(sub) + 1))


# -- the real engine -----------------------------------------------------------------------------
def test_three_turn_agent_records_exactly_what_the_engine_sampled(endpoint, engine, tokenizer):
    batch = run_agents(
        Agent(calculator_agent, "calculator_agent", False),
        endpoint,
        [(3, {"question": "What is 17*23? Use the calculator.", "expr": "17*23"})],
        AgentLimits(concurrency=2, timeout_s=60),
    )
    (sample,) = batch.samples
    assert sample.outcome == "ok" and sample.error is None, sample.error
    assert sample.reward in (0.0, 1.0) and sample.requests == 3
    assert sample.non_continuations == 0 and len(sample.segments) == 1
    t = sample.segments[0]
    assert t.turns == 3 and t.finish in ("stop", "length")
    runs = _runs(t.mask)
    assert len(runs) == 3 and [end - 1 for _, end in runs] == t.turn_ends
    # replay each turn through the engine with the session's seed: the same ids and logprobs
    for k, (start, end) in enumerate(runs):
        seed = sequence_seed(SEED, 0, 3, segment=k)
        out = engine.generate(
            [t.prompt_ids + t.response_ids[:start]],
            SAMPLING,
            seeds=[seed],
            max_new_tokens=[TURN_TOKENS],
        )
        assert out.token_ids[0] == t.response_ids[start:end]
        assert out.logprobs[0] == pytest.approx(t.logprobs[start:end], abs=0)
    # a transformers forward of the recorded ids gives the recorded logprobs (fp32, 1e-5)
    ids = torch.tensor([t.prompt_ids + t.response_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits.float()
    lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    at = [len(t.prompt_ids) + i for i, m in enumerate(t.mask) if m]
    assert sum(t.mask) == sum(end - start for start, end in runs) == len(at)
    torch.testing.assert_close(
        lp[[i - 1 for i in at]],
        torch.tensor([t.logprobs[i] for i, m in enumerate(t.mask) if m]),
        rtol=0,
        atol=1e-5,
    )
    assert all(t.logprobs[i] == 0.0 for i, m in enumerate(t.mask) if not m)
    # the spelled control token stays text: in the tool schema (prompt) and the user's message
    spelled = tokenizer.convert_tokens_to_ids(list(SPELLED))
    assert _contains(t.prompt_ids, spelled) and _contains(t.response_ids, spelled)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # template-made ends only: system, user, and per turn (closing + the user's message)
    assert t.prompt_ids.count(im_end) == 2
    metrics = batch.metrics()
    assert metrics["agent/requests_mean"].value == 3.0
    assert metrics["agent/non_continuations"].value == 0.0


def test_an_edited_history_starts_a_segment_and_is_counted(endpoint, tokenizer):
    batch = run_agents(
        Agent(editing_agent, "editing_agent", False), endpoint, [(0, {})], AgentLimits(1, 60)
    )
    (sample,) = batch.samples
    assert sample.outcome == "ok" and sample.reward is None, sample.error
    assert sample.non_continuations == 1 and len(sample.segments) == 2
    assert batch.metrics()["agent/non_continuations"].value == 1.0
    first, second = sample.segments
    assert first.turns == 1 and second.turns == 2  # the third request continued the second
    # the new segment's prompt is the edited conversation's own rendering
    edited = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "again"},
    ]
    assert second.prompt_ids == ChatDeltas(tokenizer).prompt_ids(edited)


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_requests_get_400_with_their_reason_and_are_counted(endpoint):
    key, base_url = endpoint.open_session(5)
    endpoint.take_counts()
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(model="gpt-4o", messages=user), "model"),
        (dict(model=MODEL, messages=[{"role": "wizard", "content": "hi"}]), "role"),
        (dict(model=MODEL, messages=user, tools=[{"type": "function", "function": {}}]), "tools"),
        (dict(model=MODEL, messages=user, tools=[{"type": "retrieval"}]), "tools"),
        (
            dict(model=MODEL, messages=[{"role": "user", "content": "x" * 100_000}]),
            "context_length",
        ),
    ]
    for kwargs, reason in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kwargs)
        assert e.value.status_code == 400 and e.value.code == reason, e.value
    status, body = _post(f"{base_url}/chat/completions", b"{not json")
    assert status == 400 and body["error"]["code"] == "bad_json"
    status, body = _post(f"{endpoint.url}/s/nope/v1/chat/completions", b"{}")
    assert status == 404 and body["error"]["code"] == "session"
    assert endpoint.take_counts() == {
        "bad_requests/model": 1,
        "bad_requests/role": 1,
        "bad_requests/tools": 2,
        "bad_requests/context_length": 1,
        "bad_requests/bad_json": 1,
        "bad_requests/session": 1,
    }
    session = endpoint.close_session(key)
    assert session.requests == 0 and session.segments == []  # nothing refused was recorded
    status, body = _post(
        f"{base_url}/chat/completions", json.dumps(dict(model=MODEL, messages=user)).encode()
    )
    assert status == 409 and body["error"]["code"] == "session"


# -- at the seam: tool calls, completions, the runner --------------------------------------------
TOOL_REPLY = '<tool_call>\n{"name": "calc", "arguments": {"expr": "17*23"}}\n</tool_call>'


def test_tool_calls_come_back_in_openai_format_and_the_tool_result_continues(tokenizer):
    scripted = Scripted(tokenizer, [TOOL_REPLY, "391"])
    with AgentEndpoint(scripted, tokenizer, _settings(max_turn_tokens=200)) as ep:
        key, base_url = ep.open_session(0)
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages: list = [{"role": "user", "content": "17*23?"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC])
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "calc" and json.loads(call.function.arguments) == {
            "expr": "17*23"
        }
        messages += [
            choice.message.model_dump(),
            {"role": "tool", "tool_call_id": call.id, "content": "391"},
        ]
        second = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC])
        assert second.choices[0].message.content == "391"
        session = ep.close_session(key)
    (t,) = session.trajectories()
    assert session.non_continuations == 0 and t.turns == 2
    (a, b), (c, _) = _runs(t.mask)
    delta = tokenizer.decode(t.response_ids[b:c])
    # the model's turn closed, the tool result as the template renders it, the next turn opened
    assert (
        delta
        == "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(t.response_ids[a:b]) == TOOL_REPLY + "<|im_end|>"
    assert scripted.prompts[1] == t.prompt_ids + t.response_ids[:c]  # what the engine was given


def test_a_segment_s_response_stays_within_the_run_s_response_length(tokenizer):
    """rollout.sampling.max_response_length bounds what follows a segment's first prompt (model and tool
    tokens), as it bounds an environment's trajectory: a reply is cut to the room left, and a
    request with no room left is refused (400 context_length, counted); an edited history starts
    a new segment, with a budget of its own."""
    budget = 70  # the first reply (31) and the next user turn fit; the second reply is cut
    scripted = Scripted(tokenizer, ["x" * 30])  # 30 chars and the stop token
    settings = _settings(max_turn_tokens=200, max_response_tokens=budget)
    with AgentEndpoint(scripted, tokenizer, settings) as ep:
        key, base_url = ep.open_session(0)
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages: list = [{"role": "user", "content": "go"}]
        first = client.chat.completions.create(model=MODEL, messages=messages)
        assert first.choices[0].finish_reason == "stop" and scripted.limits == [budget]
        messages += [first.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "more"}]
        second = client.chat.completions.create(model=MODEL, messages=messages)
        assert second.choices[0].finish_reason == "length"  # cut at the budget
        ep.take_counts()
        messages += [second.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "and more"}]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages)
        assert e.value.code == "context_length" and "rollout.sampling.max_response_length" in str(
            e.value
        )
        assert ep.take_counts() == {"bad_requests/context_length": 1}
        again = client.chat.completions.create(model=MODEL, messages=messages[:1])  # edited
        assert again.choices[0].finish_reason == "stop"
        session = ep.close_session(key)
    first_segment, second_segment = session.trajectories()
    assert len(first_segment.response_ids) == budget  # exactly what the run trains at most
    assert len(second_segment.response_ids) == 31 and session.non_continuations == 1
    assert scripted.limits[1] == budget - (len(scripted.prompts[1]) - len(scripted.prompts[0]))


def test_completions_continue_by_text_and_keep_spellings_as_text(tokenizer):
    scripted = Scripted(tokenizer, ["ab", "cd"])
    with AgentEndpoint(scripted, tokenizer, _settings()) as ep:
        key, base_url = ep.open_session(1)
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        prompt = f"Say {SPELLED}:"
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
        assert first.choices[0].text == "ab" and first.usage.completion_tokens == 3
        client.completions.create(model=MODEL, prompt=prompt + "ab more", max_tokens=10_000)
        # sampling is the run's: a lower max_tokens applies, the temperature is ignored, counted
        client.completions.create(model=MODEL, prompt="unrelated", max_tokens=4, temperature=0.1)
        session = ep.close_session(key)
        assert ep.take_counts() == {"ignored_params": 1}
    assert scripted.limits == [5, TURN_TOKENS, 4]
    first_seg, second_seg = session.trajectories()
    assert session.non_continuations == 1 and first_seg.turns == 2 and second_seg.turns == 1
    spelled = tokenizer.convert_tokens_to_ids(list(SPELLED))
    assert _contains(first_seg.prompt_ids, spelled)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in first_seg.prompt_ids
    assert first_seg.mask == [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]  # "ab"+stop, " more", "cd"+stop
    assert scripted.prompts[2] == second_seg.prompt_ids


def _agent_from(fn) -> Agent:
    return Agent(fn, fn.__name__, asyncio.iscoroutinefunction(fn))


def test_failing_timed_out_and_silent_agents_score_zero_and_are_counted(tokenizer):
    running, peak, lock = [0], [0], threading.Lock()

    def ok(row: dict, base_url: str, model: str) -> float:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "q"}])
            time.sleep(0.3)  # long enough for two to overlap on a loaded machine
            return 0.5
        finally:
            with lock:
                running[0] -= 1

    async def async_ok(row: dict, base_url: str, model: str) -> float:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "q"}]
        )
        return 0.25

    def raises(row: dict, base_url: str, model: str) -> float:
        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).models.list()
        raise ValueError("the agent's own bug")

    def sleeps(row: dict, base_url: str, model: str) -> float:
        time.sleep(3)
        return 1.0

    async def async_sleeps(row: dict, base_url: str, model: str) -> float:
        await asyncio.sleep(30)
        return 1.0

    def silent(row: dict, base_url: str, model: str) -> float:
        return 1.0

    def says_yes(row: dict, base_url: str, model: str) -> str:
        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "q"}]
        )
        return "yes"

    with AgentEndpoint(Scripted(tokenizer, ["fine"]), tokenizer, _settings()) as ep:

        def run(fn, n: int, timeout_s: float) -> AgentBatch:
            limits = AgentLimits(concurrency=2, timeout_s=timeout_s)
            return run_agents(_agent_from(fn), ep, [(i, {}) for i in range(n)], limits)

        good = run(ok, 6, timeout_s=30)
        assert [s.reward for s in good.samples] == [0.5] * 6 and peak[0] == 2  # the pool's bound
        assert run(async_ok, 1, timeout_s=30).samples[0].reward == 0.25
        expected = {
            raises: "error",
            sleeps: "timeout",
            async_sleeps: "timeout",
            silent: "no_requests",
            says_yes: "error",
        }
        counted = {
            "error": "agent/failures",
            "timeout": "agent/timeouts",
            "no_requests": "agent/no_requests",
        }
        for fn, outcome in expected.items():
            # the sleepers' limit is short; the others' is long enough for a loaded machine
            batch = run(fn, 1, timeout_s=0.6 if outcome == "timeout" else 30)
            (s,) = batch.samples
            assert (s.outcome, s.reward) == (outcome, 0.0), (fn.__name__, s.error)
            metrics = batch.metrics()
            assert [k for k in counted.values() if metrics[k].value] == [counted[outcome]]
            with pytest.raises(EnvError, match="failed"):
                batch.check_failures(0.5)
        assert "the agent's own bug" in (run(raises, 1, timeout_s=30).samples[0].error or "")
        assert "a finite number" in (run(says_yes, 1, timeout_s=30).samples[0].error or "")
        good.check_failures(0.0)  # nothing failed


def test_a_queue_behind_slow_agents_ends_by_the_batch_deadline(tokenizer):
    """Agents share one deadline per batch (rollout's part of trainer.hang_timeout_s): one that
    waited in the pool starts with what is left, and none starts once it is spent; the batch
    returns by then instead of holding the step until the watchdog ends the run."""
    limits = AgentLimits(concurrency=1, timeout_s=30, batch_deadline_s=2.0)
    assert limits.left(10.0, 10.5) == 1.5 and limits.left(10.0, 13.0) == -1.0
    assert AgentLimits(1, 30).left(10.0, 1e6) == 30  # no deadline: each agent's own limit

    def asks_then_works(row: dict, base_url: str, model: str) -> float:
        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "q"}]
        )
        time.sleep(0.5)  # its tool: five of these one after the other need 2.5 s and more
        return 1.0

    with AgentEndpoint(Scripted(tokenizer, ["fine"] * 5), tokenizer, _settings()) as ep:
        batch = run_agents(_agent_from(asks_then_works), ep, [(i, {}) for i in range(5)], limits)
    outcomes = [s.outcome for s in batch.samples]
    assert outcomes[0] == "ok" and outcomes[-1] == "timeout", outcomes
    assert set(outcomes) == {"ok", "timeout"} and outcomes == sorted(outcomes)  # ok ones first
    assert batch.seconds < 2.0 + 1.0, batch.seconds  # the deadline, and a loaded machine's slack
    never_started = [s for s in batch.samples if not s.segments and s.outcome == "timeout"]
    assert never_started and all("was not started" in (s.error or "") for s in never_started)
    assert all(s.reward == 0.0 for s in batch.samples if s.outcome == "timeout")
    assert batch.metrics()["agent/timeouts"].value == outcomes.count("timeout")


# -- the loader and the config -------------------------------------------------------------------
def test_the_loader_names_the_fix(tmp_path):
    file = tmp_path / "agents.py"
    file.write_text(
        "async def solve(row, base_url, model):\n    return 1.0\n"
        "def plain(row, base_url, model):\n    return None\n"
        "def two(row, base_url):\n    return None\n"
        "class Solver:\n    pass\n"
        "NUMBER = 3\n"
    )
    assert load_agent(f"{file}:solve").is_async and not load_agent(f"{file}:plain").is_async
    for spec, message in (
        (f"{tmp_path}/missing.py:solve", "does not exist"),
        (f"{file}:nothing", "has no attribute 'nothing'"),
        (f"{file}:NUMBER", "not callable"),
        (f"{file}:Solver", "is a class"),
        (f"{file}:two", r"cannot be called as two\(row, base_url, model\)"),
        ("no_colon", "is not an agent path"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_agent(spec)


def test_rollout_agent_is_refused_before_any_model_is_built(tmp_path):
    file = tmp_path / "agent.py"
    file.write_text("def solve(row, base_url, model):\n    return 1.0\n")
    base = [
        f"model.path={tiny_char_llama_dir()}",
        "data.train_files=[/nonexistent/train.parquet]",
        f"rollout.agent={file}:solve",
    ]
    for extra, message in (
        (["rollout.engine.backend=hf", "rollout.env=x.py:Env"], "one or the other"),
        (
            [
                "rollout.engine.backend=hf",
                "rollout.placement.partial=true",
                "rollout.placement.mode=async",
                "parallel.rollout_ranks=1",
            ],
            "one version's weights",
        ),
        (["rollout.engine.backend=hf", "rollout.agent_timeout_s=0"], "must be > 0"),
        (
            [
                "rollout.engine.backend=hf",
                "rollout.agent_timeout_s=600",
                "trainer.hang_timeout_s=600",
            ],
            r"not below trainer\.hang_timeout_s=600: .* raise trainer\.hang_timeout_s",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*base, *extra])
    assert load_config(
        None, [*base, "rollout.engine.backend=vllm"]
    ).rollout.agent  # both backends serve
    # and both placements: the asynchronous rollout group runs agents as colocated does
    placed = [
        *base,
        "rollout.engine.backend=hf",
        "rollout.placement.mode=async",
        "parallel.rollout_ranks=1",
    ]
    assert load_config(None, placed).rollout.placement.mode == "async"
    # a good agent passes (the data files' check is next); a missing one is refused before it
    cfg = load_config(None, [*base, "rollout.engine.backend=hf"])
    with pytest.raises(DataError, match=r"/nonexistent/train\.parquet"):
        check_inputs(cfg, ParallelLayout(), this_machine=False)
    absent = [*base[:2], f"rollout.agent={tmp_path}/absent.py:solve", "rollout.engine.backend=hf"]
    with pytest.raises(ConfigError, match="does not exist"):
        check_inputs(load_config(None, absent), ParallelLayout(), this_machine=False)
    with pytest.raises(ConfigError, match="does not exist"):
        check_agent_setting(f"{tmp_path}/absent.py:solve")


def test_the_documented_agent_runs(tmp_path, tokenizer):
    """docs/agents.md's example, loaded as rollout.agent loads it, against a scripted model that
    calls its calculator and then answers."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
    code = re.search(r"```python\n(.*?)```", docs.read_text(encoding="utf-8"), re.DOTALL)
    assert code is not None
    file = tmp_path / "calc_agent.py"
    file.write_text(code.group(1))
    agent = load_agent(f"{file}:solve")
    scripted = Scripted(tokenizer, [TOOL_REPLY, "It is 391."])
    with AgentEndpoint(scripted, tokenizer, _settings(max_turn_tokens=200)) as ep:
        batch = run_agents(
            agent, ep, [(0, {"question": "17*23?", "answer": "391"})], AgentLimits(1, 30)
        )
    (sample,) = batch.samples
    assert (sample.outcome, sample.reward, sample.requests) == ("ok", 1.0, 2), sample.error
    # the calculator's result went back as the tool message
    assert "<tool_response>\n391\n</tool_response>" in tokenizer.decode(scripted.prompts[1])
