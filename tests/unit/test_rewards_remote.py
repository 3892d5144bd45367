"""The remote reward service client (reward.remote_url) against a real HTTP server on 127.0.0.1:
batches in order, extra metrics, retries with backoff on 503 and refused connections, bad answers
and timeouts counted per batch, bounded concurrency, the pre-launch check, and its scores in a
rollout's reward next to a rule scorer's (and in the failed-score guard)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from megarl.config import OverlongBufferConfig, load_config, validate
from megarl.data import PromptItem
from megarl.errors import ConfigError
from megarl.rewards.manager import RewardError, RewardManager, RewardSample
from megarl.rewards.remote import RemoteScorer
from megarl.rewards.remote_protocol import BadAnswer, parse_answer, request_body
from megarl.rewards.remote_settings import RemoteSettings
from megarl.rewards.shares import combination
from megarl.rollout.rollout_batch import RolloutBatch, replies_batch
from megarl.rollout.rollout_types import RolloutOutput
from megarl.trainer.experience import RewardSources, score_rollout
from megarl.trainer.model_ops import MicroBatching
from tests.assets import qwen25_tokenizer_dir

pytestmark = pytest.mark.unit

# (status, body, seconds to wait before answering) for a request's samples
Reply = tuple[int, bytes, float]


def scores_of(samples: list[dict]) -> Reply:
    """The default answer: each response's length, as an object with a metric for 'm*' responses."""
    scores: list[object] = []
    for s in samples:
        n = float(len(s["response"]))
        scores.append(
            {"score": n, "vowels": sum(c in "aeiou" for c in s["response"])}
            if s["response"].startswith("m")
            else n
        )
    return 200, json.dumps({"scores": scores}).encode(), 0.0


class ScriptedServer(ThreadingHTTPServer):
    """Answers each POST with ``reply(samples)``; records every request's samples, and how many
    requests were in flight at most. ``refuse_first``: that many requests get 503 first."""

    daemon_threads = True

    def __init__(self, reply: Callable[[list[dict]], Reply], refuse_first: int = 0) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.reply = reply
        self.refuse = refuse_first
        self.requests: list[list[dict]] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class Handler(BaseHTTPRequestHandler):
    server: ScriptedServer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        s = self.server
        samples = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["samples"]
        with s.lock:
            s.requests.append(samples)
            s.in_flight += 1
            s.most_in_flight = max(s.most_in_flight, s.in_flight)
            refuse = s.refuse > 0
            s.refuse -= refuse
        try:
            status, body, delay = (503, b"busy", 0.0) if refuse else s.reply(samples)
            time.sleep(delay)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass
        finally:
            with s.lock:
                s.in_flight -= 1


@pytest.fixture
def serve() -> Iterator[Callable[..., ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def start(reply: Callable[[list[dict]], Reply] = scores_of, refuse_first: int = 0):
        server = ScriptedServer(reply, refuse_first)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def samples(*responses: str) -> list[RewardSample]:
    return [
        RewardSample("math", r, np.int64(7), {"row": i}, [{"role": "user", "content": f"q{i}"}])
        for i, r in enumerate(responses)
    ]


def scorer(url: str, **kw: object) -> RemoteScorer:
    settings = dict(batch_size=2, concurrency=2, timeout_s=5.0, retries=2, backoff_s=0.01)
    settings.update(kw)
    return RemoteScorer(RemoteSettings(url, **settings))  # type: ignore[arg-type]


def test_scores_come_back_in_order_across_batches_with_their_metrics(serve):
    server = serve()
    result = scorer(server.url).score(samples("a", "mama", "xyz", "me", "hello"))
    assert result.scores == [1.0, 4.0, 3.0, 2.0, 5.0]
    assert not result.failures
    assert sorted(len(r) for r in server.requests) == [1, 2, 2]  # batches of 2
    assert result.metrics["reward/remote_mean"] == pytest.approx(3.0)
    assert result.metrics["reward/remote/vowels"] == pytest.approx(1.5)  # "mama" 2, "me" 1
    assert result.metrics["reward/remote_samples/vowels"] == 2  # only those two returned it
    assert result.metrics["reward/remote_failures"] == 0
    assert result.metrics["reward/remote_retries"] == 0
    assert result.metrics["reward/remote_samples"] == 5
    # how each combines over DP ranks is declared, the extras' too (a mean over their count)
    assert all(combination(k, result.metrics) is not None for k in result.metrics)
    first = next(r for r in server.requests if r[0]["response"] == "a")[0]
    assert first == {
        "data_source": "math",
        "prompt": [{"role": "user", "content": "q0"}],
        "response": "a",
        "ground_truth": 7,  # a numpy value from parquet, as JSON
        "extra_info": {"row": 0},
    }


def test_a_503_is_retried_after_a_backoff(serve):
    server = serve(refuse_first=1)
    started = time.monotonic()
    result = scorer(server.url, batch_size=8, backoff_s=0.2).score(samples("ab", "c"))
    assert time.monotonic() - started >= 0.2
    assert result.scores == [2.0, 1.0] and not result.failures
    assert len(server.requests) == 2 and result.metrics["reward/remote_retries"] == 1


def test_when_retries_are_spent_the_batch_counts_as_failed(serve, caplog):
    server = serve(refuse_first=100)
    with caplog.at_level(logging.WARNING, "megarl.rewards.remote"):
        result = scorer(server.url, batch_size=8, retries=2).score(samples("ab", "c"))
    assert len(server.requests) == 3  # the request and 2 retries
    assert result.scores == [0.0, 0.0]
    assert [(f.index, f.status) for f in result.failures] == [(0, "error"), (1, "error")]
    assert "HTTP 503: 'busy' (after 2 retries)" in result.failures[0].message
    assert result.metrics["reward/remote_failures"] == 2


def test_a_refused_connection_is_retried_then_counted():
    url = f"http://127.0.0.1:{free_port()}/score"
    result = scorer(url, retries=1).score(samples("a", "b", "c"))
    assert len(result.failures) == 3
    assert "ClientConnectorError" in result.failures[0].message
    assert "(after 1 retries)" in result.failures[0].message


def bad(body: bytes, status: int = 200) -> Callable[[list[dict]], Reply]:
    """Answers ``body`` to the batch holding the response 'bad', the default to the others."""

    def reply(samples: list[dict]) -> Reply:
        if any(s["response"] == "bad" for s in samples):
            return status, body, 0.0
        return scores_of(samples)

    return reply


@pytest.mark.parametrize(
    ("body", "status", "why"),
    [
        (b"<html>oops</html>", 200, "the answer is not JSON"),
        (b'{"score": [1, 2]}', 200, 'not an object with a "scores" list'),
        (b'{"scores": [1.0]}', 200, "the answer has 1 scores for 2 samples"),
        (b'{"scores": [NaN, 1.0]}', 200, "scores[0] is nan, not a finite number"),
        (b'{"scores": ["1.0", 1.0]}', 200, "scores[0] is str '1.0', not a number"),
        (b'{"scores": [{"value": 1}, 1.0]}', 200, "scores[0] is an object without a 'score' key"),
        (b'{"scores": [{"score": 1, "why": "x"}, 1]}', 200, "scores[0]['why'] is str 'x'"),
        (b"no such path", 404, "HTTP 404: 'no such path'"),
    ],
)
def test_a_bad_answer_fails_its_batch_only_and_is_shown_once(serve, caplog, body, status, why):
    server = serve(bad(body, status))
    with caplog.at_level(logging.WARNING, "megarl.rewards.remote"):
        result = scorer(server.url).score(samples("bad", "x", "yy", "zzz"))
    assert result.scores == [0.0, 0.0, 2.0, 3.0]
    assert [f.index for f in result.failures] == [0, 1]
    assert why in result.failures[0].message
    assert repr(body.decode()) in result.failures[0].message  # the answer itself, quoted
    assert len(server.requests) == 2  # a bad answer is not retried
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "2 of 4 samples failed" in warnings[0] and why in warnings[0]


def test_a_slow_server_times_out_and_is_counted_not_retried(serve):
    def slow(samples: list[dict]) -> Reply:
        status, body, _ = scores_of(samples)
        return status, body, 3.0 if samples[0]["response"] == "slow" else 0.0

    server = serve(slow)
    started = time.monotonic()
    result = scorer(server.url, timeout_s=0.5).score(samples("slow", "a", "bb"))
    assert time.monotonic() - started < 2.5
    assert result.scores == [0.0, 0.0, 2.0]
    assert [(f.index, f.status) for f in result.failures] == [(0, "timeout"), (1, "timeout")]
    assert "no answer within reward.remote_timeout_s=0.5 s" in result.failures[0].message
    assert result.metrics["reward/remote_timeouts"] == 2
    assert len(server.requests) == 2


def test_at_most_concurrency_requests_are_in_flight(serve):
    def slowly(samples: list[dict]) -> Reply:
        status, body, _ = scores_of(samples)
        return status, body, 0.2

    server = serve(slowly)
    result = scorer(server.url, batch_size=1, concurrency=3).score(samples(*"abcdefghi"))
    assert result.scores == [1.0] * 9
    assert server.most_in_flight == 3


def test_strict_mode_raises_on_the_first_failure(serve):
    server = serve(bad(b"{}"))
    remote = RemoteScorer(RemoteSettings(server.url, batch_size=2, backoff_s=0), strict=True)
    with pytest.raises(RewardError, match=r"reward.remote_url=.*failed on sample 0 \(error\)"):
        remote.score(samples("bad", "x"))


def test_the_prelaunch_check_names_the_url_and_the_error(serve):
    ok = serve(refuse_first=1)  # a 503 first: retried
    scorer(ok.url).check_reachable()
    assert ok.requests == [[], []]  # an empty batch, twice
    url = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(ConfigError) as e:
        scorer(url, retries=1).check_reachable()
    assert f"reward.remote_url={url} does not answer" in str(e.value)
    assert "ClientConnectorError" in str(e.value) and "docs/rewards.md" in str(e.value)
    wrong = serve(lambda s: (404, b"not here", 0.0))
    with pytest.raises(ConfigError, match=r"HTTP 404: 'not here'"):
        scorer(wrong.url).check_reachable()


def test_the_protocol_pieces():
    body = json.loads(request_body(samples("a")))
    assert body["samples"][0]["ground_truth"] == 7 and body["samples"][0]["response"] == "a"
    got = parse_answer(b'{"scores": [1, 0.5, {"score": -2, "ok": 1}]}', 3)
    assert [s.score for s in got] == [1.0, 0.5, -2.0] and got[2].metrics == {"ok": 1.0}
    with pytest.raises(BadAnswer, match="scores\\[2\\]\\['ok'\\] is bool"):
        parse_answer(b'{"scores": [1, 0.5, {"score": -2, "ok": true}]}', 3)
    with pytest.raises(BadAnswer, match="scores\\[0\\] is bool"):
        parse_answer(b'{"scores": [true]}', 1)
    with pytest.raises(BadAnswer, match="is inf"):
        parse_answer(b'{"scores": [Infinity]}', 1)


def test_remote_settings_are_checked_with_the_config():
    base = ["model.path=/m", "data.train_files=[/x.parquet]"]
    validate(load_config(None, [*base, "reward.remote_url=http://h:1/s", "reward.rule_weight=0"]))
    for extra, message in [
        (["reward.remote_url=h:1/s"], "must be an http:// or https:// URL"),
        (["reward.remote_url=http://h/s", "reward.remote_batch_size=0"], "remote_batch_size=0"),
        (["reward.remote_url=http://h/s", "reward.remote_timeout_s=0"], "remote_timeout_s=0"),
        (["reward.remote_url=http://h/s", "reward.remote_retries=-1"], "remote_retries=-1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(load_config(None, [*base, *extra]))
    assert RemoteSettings.from_config(load_config(None, base).reward) is None


def rollout(tok, answers: list[str]) -> tuple[RolloutBatch, PromptItem]:
    ids = [[*tok.encode(a), tok.eos_token_id] for a in answers]
    out = RolloutOutput(
        prompt_index=[0] * len(answers),
        token_ids=ids,
        logprobs=[[-0.1] * len(i) for i in ids],
        finish_reasons=["stop"] * len(answers),
    )
    item = PromptItem(
        uid=0,
        input_ids=[5, 6, 7],
        prompt="What is 2 + 3?",
        data_source="arithmetic",
        ground_truth="5",
    )
    return replies_batch([[5, 6, 7]], out), item


def test_a_rollout_sums_rule_and_remote_scores_with_their_weights(serve):
    server = serve()
    tok = AutoTokenizer.from_pretrained(qwen25_tokenizer_dir())
    batch, item = rollout(tok, ["5", "6 apples"])
    remote = scorer(server.url)
    rewards = RewardSources(
        RewardManager(),
        None,
        0.5,
        1.0,
        OverlongBufferConfig(),
        64,
        remote=remote,
        remote_weight=2.0,
    )
    _, scores, metrics, _ = score_rollout(
        rewards, tok, 0, [item], batch, MicroBatching(), shaping=False
    )
    # rule: "5" right (1), "6 apples" wrong (0); remote: the responses' lengths 1 and 8
    assert scores.tolist() == pytest.approx([0.5 * 1 + 2 * 1, 0.5 * 0 + 2 * 8])
    assert metrics["reward/rule_mean"] == pytest.approx(0.5)
    assert metrics["reward/remote_mean"] == pytest.approx(4.5)
    assert metrics["reward/rollout_samples"] == metrics["reward/remote_samples"] == 2
    # the manager's reward/mean aside (the step's comes from the scores), each metric declares
    # how it combines over DP ranks
    assert [k for k in metrics if combination(k, metrics) is None] == ["reward/mean"]
    assert server.requests[0][0]["prompt"] == "What is 2 + 3?"
    rewards.close()


def test_a_failing_remote_service_stops_the_run_naming_its_url(serve):
    server = serve(lambda s: (200, b'{"scores": "soon"}', 0.0))
    tok = AutoTokenizer.from_pretrained(qwen25_tokenizer_dir())
    batch, item = rollout(tok, ["5", "6"])
    rewards = RewardSources(
        RewardManager(), None, 0.0, 1.0, OverlongBufferConfig(), 64, remote=scorer(server.url)
    )
    with pytest.raises(RewardError) as e:
        score_rollout(rewards, tok, 0, [item], batch, MicroBatching(), shaping=False)
    message = str(e.value)
    assert "2 of 2 samples (100%) failed to score" in message
    assert f"the remote reward service reward.remote_url={server.url}" in message
    assert 'not an object with a "scores" list' in message and "response '5'" in message


def docs_server() -> str:
    """The example service of docs/rewards.md."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "rewards.md").read_text()
    section = text.split("### A service in")[1]
    return section.split("```python\n")[1].split("```")[0]


def test_the_docs_example_service_answers_the_client(tmp_path):
    (tmp_path / "reward_server.py").write_text(docs_server())
    port = free_port()
    server = subprocess.Popen([sys.executable, str(tmp_path / "reward_server.py"), str(port)])
    try:
        remote = scorer(f"http://127.0.0.1:{port}/score", retries=6, backoff_s=0.1)
        remote.check_reachable()  # retried while the service starts
        result = remote.score(samples("so it is 7", "8", "#### 7"))
    finally:
        server.kill()
        server.wait()
    assert result.scores == [1.0, 0.0, 1.0] and not result.failures
    assert result.metrics["reward/remote/length"] == pytest.approx((10 + 1 + 6) / 3)
    assert len(docs_server().strip().splitlines()) <= 25
