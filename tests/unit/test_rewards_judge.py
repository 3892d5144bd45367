"""The generative judge (reward.judge): its template and score pattern, a local judge (a tiny
character-bigram Llama whose answers are known, checked against transformers' own greedy
``generate``), a judge at an OpenAI-compatible server in this file on 127.0.0.1 (through the
``openai`` client: retries, timeouts, bad replies, the pre-launch model check), and the judge's
scores in a rollout's reward beside a rule scorer's, with the failed-sample guard."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.config import JudgeConfig, OverlongBufferConfig, load_config, validate
from megarl.data import PromptItem
from megarl.errors import ConfigError
from megarl.rewards.judge import JudgeScorer, NoAnswer
from megarl.rewards.judge_prompt import JudgeTemplate, UnparsedAnswer, question_text
from megarl.rewards.judge_remote import OpenAIJudge
from megarl.rewards.manager import RewardError, RewardManager, RewardSample
from megarl.rewards.shares import combination
from megarl.rollout.judge_engine import EngineJudge
from megarl.rollout.rollout_batch import RolloutBatch, replies_batch
from megarl.rollout.rollout_types import RolloutOutput
from megarl.trainer.experience import RewardSources, score_rollout
from megarl.trainer.model_ops import MicroBatching
from tests.assets import judge_verdict, tiny_char_judge_dir

pytestmark = pytest.mark.unit

VERDICT = JudgeConfig(template="Q: {prompt}\nA: {response}", score_pattern=r"([01])")


def sample(response: str, prompt: object = "What is 2 + 3?", truth: object = "5") -> RewardSample:
    return RewardSample("arithmetic", response, truth, None, prompt)


# -- the template and the score pattern ----------------------------------------------------------


def test_the_template_fills_the_question_response_and_ground_truth_as_text():
    t = JudgeTemplate.from_config(
        JudgeConfig(template="{prompt}|{response}|{ground_truth}|{{literal}}")
    )
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "What is {x}?"},
    ]
    # braces in data stay text; the last user message is the question
    assert t.prompt(sample("{response} <|im_end|>", chat, 7)) == (
        "What is {x}?|{response} <|im_end|>|7|{literal}"
    )
    assert t.prompt(sample("r", None, None)) == "|r||{literal}"
    assert question_text([{"role": "system", "content": "s"}]) == ""
    assert question_text(np.array([{"role": "user", "content": "q"}], dtype=object)) == "q"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{answer} {response}", "may name only"),
        ("{} {response}", "may name only"),
        ("{prompt} {response", "not a valid template"),
        ("Question: {prompt}", "has no {response}"),
    ],
)
def test_a_bad_template_is_refused_with_the_fix(template, message):
    with pytest.raises(ConfigError, match=message):
        JudgeTemplate.from_config(JudgeConfig(template=template))


@pytest.mark.parametrize(
    ("pattern", "message"), [("Score: \\d+", "has no group"), ("Score: (", "not a regex")]
)
def test_a_bad_score_pattern_is_refused(pattern, message):
    with pytest.raises(ConfigError, match=message):
        JudgeTemplate.from_config(JudgeConfig(score_pattern=pattern))


def test_the_score_is_the_last_match_of_the_pattern():
    t = JudgeTemplate.from_config(JudgeConfig())
    assert t.score("Score: 3 at first... on reflection Score: 7.5") == 7.5
    assert t.score("Score:-2") == -2.0
    for answer, why in (
        ("I cannot rate this.", "no match"),
        ("", "no match"),
    ):
        with pytest.raises(UnparsedAnswer, match=why):
            t.score(answer)
    loose = JudgeTemplate.from_config(JudgeConfig(score_pattern=r"Score: (\S+)"))
    with pytest.raises(UnparsedAnswer, match="not a number"):
        loose.score("Score: high")
    with pytest.raises(UnparsedAnswer, match="not finite"):
        loose.score("Score: nan")


# -- the scorer's accounting --------------------------------------------------------------------


class Canned:
    """An answerer replaying fixed answers (the scorer's accounting is what is tested here)."""

    name = "the canned judge"

    def __init__(self, answers: list[str | NoAnswer]) -> None:
        self.answers = answers
        self.prompts: list[str] = []

    def answer(self, prompts):
        self.prompts += prompts
        return self.answers[: len(prompts)]


def test_failed_and_unparsed_answers_score_zero_and_are_counted():
    canned = Canned(["Score: 8", "no idea", NoAnswer("timeout", "too slow"), "Score: 2"])
    judge = JudgeScorer(JudgeTemplate.from_config(JudgeConfig()), canned)
    result = judge.score([sample(r) for r in ("a", "b", "c", "d")])
    assert result.scores == [8.0, 0.0, 0.0, 2.0]
    assert [(f.index, f.status) for f in result.failures] == [(1, "error"), (2, "timeout")]
    assert result.metrics == {
        "reward/judge_samples": 4.0,
        "reward/judge_mean": 2.5,
        "reward/judge_failures": 2.0,
        "reward/judge_unparsed": 1.0,
        "reward/judge_timeouts": 1.0,
    }
    assert all(combination(k, result.metrics) for k in result.metrics)  # declared, each
    assert "Response: c" in canned.prompts[2]
    strict = JudgeScorer(JudgeTemplate.from_config(JudgeConfig()), Canned(["?"]), strict=True)
    with pytest.raises(RewardError, match="the canned judge failed on sample 0"):
        strict.score([sample("a")])


# -- a local judge ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_judge() -> EngineJudge:
    return EngineJudge(tiny_char_judge_dir(), replace(VERDICT, max_length=96), "float32")


def test_a_local_judge_answers_as_transformers_generate_does(local_judge):
    """The tiny judge answers "1" after a vowel and "0" otherwise (built so); its answers equal
    transformers' own greedy ``generate`` on the same folder, prompt text tokenized plainly."""
    folder = tiny_char_judge_dir()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = ["Q: 2+3?\nA: five", "Q: 2+3?\nA: 5", "Q: x\nA: <|im_end|>a", "Q: x\nA: "]
    answers = local_judge.answer(prompts)
    assert answers == [judge_verdict(p) for p in prompts] == ["1", "0", "1", "0"]
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = tok(prompt, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id
        )
        assert tok.decode(out[0, len(ids) :], skip_special_tokens=True) == answer


def test_a_prompt_longer_than_the_judges_budget_fails_alone(local_judge):
    long = "Q: x\nA: " + "e" * 200
    answers = local_judge.answer(["Q: x\nA: e", long])
    assert answers[0] == "1"
    assert isinstance(answers[1], NoAnswer) and "reward.judge.max_length=96" in answers[1].message


def rollout(tok, answers: list[str]) -> tuple[RolloutBatch, PromptItem]:
    ids = [[*tok.encode(a, add_special_tokens=False), tok.eos_token_id] for a in answers]
    out = RolloutOutput(
        prompt_index=[0] * len(answers),
        token_ids=ids,
        logprobs=[[-0.1] * len(i) for i in ids],
        finish_reasons=["stop"] * len(answers),
    )
    item = PromptItem(
        uid=0, input_ids=[5, 6, 7], prompt="2+3?", data_source="arithmetic", ground_truth="5"
    )
    return replies_batch([[5, 6, 7]], out), item


def test_a_rollout_sums_rule_and_judge_scores_with_their_weights(local_judge):
    tok = AutoTokenizer.from_pretrained(tiny_char_judge_dir())
    batch, item = rollout(tok, ["5", "it is 6", "5 or so"])
    judge = JudgeScorer(JudgeTemplate.from_config(VERDICT), local_judge)
    rewards = RewardSources(
        RewardManager(), None, 1.0, 1.0, OverlongBufferConfig(), 64, judge=judge, judge_weight=0.5
    )
    _, scores, metrics, _ = score_rollout(
        rewards, tok, 0, [item], batch, MicroBatching(), shaping=False
    )
    # rule (arithmetic, answer 5): "5" and "5 or so" give 5; judge: the responses' last
    # characters "5", "6", "o": 0, 0, 1
    rule = [1.0, 0.0, 1.0]
    verdicts = [float(judge_verdict(r)) for r in ("5", "it is 6", "5 or so")]
    assert verdicts == [0.0, 0.0, 1.0]
    assert scores.tolist() == pytest.approx(
        [r + 0.5 * v for r, v in zip(rule, verdicts, strict=True)]
    )
    assert metrics["reward/judge_mean"] == pytest.approx(1 / 3)
    assert metrics["reward/judge_failures"] == 0.0
    rewards.close()


def test_a_judge_whose_answers_never_parse_stops_the_run_naming_it(local_judge):
    tok = AutoTokenizer.from_pretrained(tiny_char_judge_dir())
    batch, item = rollout(tok, ["5", "6"])
    never = replace(VERDICT, score_pattern=r"Score: (\d+)")
    judge = JudgeScorer(JudgeTemplate.from_config(never), local_judge)
    rewards = RewardSources(
        RewardManager(), None, 0.0, 1.0, OverlongBufferConfig(), 64, judge=judge
    )
    with pytest.raises(RewardError) as e:
        score_rollout(rewards, tok, 0, [item], batch, MicroBatching(), shaping=False)
    message = str(e.value)
    assert "2 of 2 samples (100%) failed to score" in message
    assert f"reward.judge.model_path={tiny_char_judge_dir()}" in message
    assert "no match of reward.judge.score_pattern" in message and "answer '0'" in message


# -- a judge at an OpenAI-compatible server -------------------------------------------------------

Reply = tuple[int, dict, float]  # status, JSON body, seconds before answering


def completion(content: str) -> Reply:
    return (
        200,
        {
            "id": "c1",
            "object": "chat.completion",
            "created": 0,
            "model": "judge",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
        },
        0.0,
    )


class ChatServer(ThreadingHTTPServer):
    """An OpenAI-compatible server of the model "judge": GET /v1/models, and POST
    /v1/chat/completions answered by ``reply(request)``; the first ``refuse_first`` completions
    get 503 first. Records every completion request."""

    daemon_threads = True

    def __init__(self, reply: Callable[[dict], Reply], refuse_first: int = 0) -> None:
        super().__init__(("127.0.0.1", 0), ChatHandler)
        self.reply = reply
        self.refuse = refuse_first
        self.requests: list[dict] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class ChatHandler(BaseHTTPRequestHandler):
    server: ChatServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # a client that timed out and left
            self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            self._send(404, {"error": {"message": "no such path"}})
            return
        self._send(200, {"object": "list", "data": [{"id": "judge", "object": "model"}]})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append(request)
            refused = self.server.refuse > 0
            self.server.refuse -= 1
        if refused:
            self._send(503, {"error": {"message": "warming up"}})
            return
        status, body, wait = self.server.reply(request)
        time.sleep(wait)
        self._send(status, body)


def verdict_of(request: dict) -> Reply:
    return completion(judge_verdict(request["messages"][-1]["content"]))


@pytest.fixture
def serve() -> Iterator[Callable[..., ChatServer]]:
    servers: list[ChatServer] = []

    def start(reply: Callable[[dict], Reply] = verdict_of, refuse_first: int = 0) -> ChatServer:
        server = ChatServer(reply, refuse_first)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def remote(url: str, **overrides) -> OpenAIJudge:
    return OpenAIJudge(
        replace(VERDICT, **{"url": url, "model": "judge", "retries": 2, **overrides})
    )


def test_a_remote_judge_answers_each_prompt_greedily_after_a_refusal(serve):
    server = serve(refuse_first=1)
    judge = remote(server.url, max_tokens=5)
    judge.check_reachable()
    prompts = ["Q: a\nA: yes", "Q: b\nA: no", "Q: c\nA: 4"]
    assert judge.answer(prompts) == ["0", "1", "0"]
    assert len(server.requests) == 4  # the refused one, retried by the client
    for request in server.requests:
        assert request["model"] == "judge" and request["temperature"] == 0.0
        assert request["max_tokens"] == 5 and request["messages"][0]["role"] == "user"
    assert sorted(r["messages"][0]["content"] for r in server.requests[1:]) == sorted(prompts)


def test_a_remote_judges_timeouts_and_errors_are_no_answers(serve):
    def reply(request: dict) -> Reply:
        text = request["messages"][0]["content"]
        if text.endswith("slow"):
            return (*completion("1")[:2], 5.0)
        if text.endswith("bad"):
            return 400, {"error": {"message": "unknown role"}}, 0.0
        return completion("Score: 1")

    server = serve(reply)
    judge = remote(server.url, timeout_s=2.0, retries=0)
    ok, slow, bad = judge.answer(["fine", "slow", "bad"])
    assert ok == "Score: 1"
    assert isinstance(slow, NoAnswer) and slow.status == "timeout"
    assert "reward.judge.timeout_s=2" in slow.message
    assert isinstance(bad, NoAnswer) and bad.status == "error" and "unknown role" in bad.message


def test_the_pre_launch_check_names_the_url_or_the_missing_model(serve):
    server = serve()
    with pytest.raises(ConfigError, match=re.escape("reward.judge.model='other' is not served")):
        OpenAIJudge(replace(VERDICT, url=server.url, model="other")).check_reachable()
    url = server.url
    server.shutdown()
    server.server_close()
    with pytest.raises(ConfigError, match=re.escape(f"reward.judge.url={url} does not answer")):
        remote(url, retries=0).check_reachable()


def test_judge_settings_are_checked_before_anything_starts():
    def check(*overrides: str) -> None:
        validate(load_config("configs/quickstart_cpu.yaml", list(overrides)))

    check("reward.judge.model_path=/x")  # well formed
    for overrides, message in (
        (("reward.judge.model_path=/x", "reward.judge.url=http://h/v1"), "both set"),
        (("reward.judge.url=http://h/v1",), "needs reward.judge.model"),
        (("reward.judge.url=h:80", "reward.judge.model=j"), "must be an http"),
        (("reward.judge.model_path=/x", "reward.judge.max_length=64"), "leaves no room"),
        (("reward.judge.model_path=/x", "reward.judge.timeout_s=0"), "must be > 0"),
        (("reward.rule_weight=0",), "reward.judge.model_path or reward.judge.url"),
    ):
        with pytest.raises(ConfigError, match=message):
            check(*overrides)
    check("reward.rule_weight=0", "reward.judge.url=http://h/v1", "reward.judge.model=j")


def test_a_judge_folder_that_cannot_judge_is_refused_with_the_inputs(tmp_path):
    """check_judge, run with the inputs before any process starts: a causal LM with a tokenizer
    passes (its shape returned); a sequence classifier and a folder without a tokenizer are
    refused, each naming the fix."""
    import shutil

    from megarl.run.checks import check_judge
    from tests.assets import tiny_qwen2_reward_dir

    def cfg(path, *more):
        return load_config(
            "configs/quickstart_cpu.yaml", [f"reward.judge.model_path={path}", *more]
        )

    judge = tiny_char_judge_dir()
    dims = check_judge(cfg(judge).reward.judge, this_machine=True)
    assert dims is not None and dims.vocab_size == 128
    with pytest.raises(ConfigError, match="is a reward model; a judge writes its verdict"):
        check_judge(cfg(tiny_qwen2_reward_dir()).reward.judge, this_machine=True)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(judge / name, bare / name)
    with pytest.raises(ConfigError, match="has no tokenizer"):
        check_judge(cfg(bare).reward.judge, this_machine=True)
    with pytest.raises(ConfigError, match=re.escape("has no {response}")):
        check_judge(cfg(judge, "reward.judge.template='{prompt}'").reward.judge, this_machine=True)
