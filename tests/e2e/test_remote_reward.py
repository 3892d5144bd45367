"""A quickstart-size GRPO run scored by a remote reward service (reward.remote_url) and a
generative judge (reward.judge), as a user runs it: the service is an HTTP server in this file on
127.0.0.1 that refuses the first batch of samples once with 503 (the client retries it) and
scores each response by its share of vowels, with its length as an extra metric; the judge is a
tiny character-bigram model whose greedy answer is known ("1" when its prompt ends with a vowel,
else "0"), weighted 0.5. The run trains on exactly the service's scores plus half the judge's;
with no service (or no judge server) listening, `megarl train` stops with exit 2 before any rank
starts."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.assets import judge_verdict, tiny_char_judge_dir, tiny_char_llama_dir
from tests.e2e.test_train import by_step, launch, megarl_command, metrics

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart_cpu.yaml"
STEPS = 3
SAMPLES_PER_STEP = 4 * 4  # data.train_batch_size x rollout.sampling.n
JUDGE_WEIGHT = 0.5
JUDGE_TEMPLATE = "Q: {prompt}\nA: {response}"  # the judge's verdict: the response's last character


def vowel_share(text: str) -> float:
    return sum(c in "aeiouAEIOU" for c in text) / max(len(text), 1)


class RewardService(ThreadingHTTPServer):
    """Scores each sample's response (its vowel share, its length as a metric); records every
    sample it scored, in the order of its answers, and every empty batch (the pre-launch check)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), ServiceHandler)
        self.scored: list[dict] = []  # {"response", "score", "length", "sample"}
        self.empty_batches = 0
        self.refused = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class ServiceHandler(BaseHTTPRequestHandler):
    server: RewardService

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        s = self.server
        samples = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["samples"]
        with s.lock:
            if not samples:
                s.empty_batches += 1
            elif s.refused == 0:  # the first batch of samples: refused once
                s.refused += 1
                self._answer(503, b'{"error": "warming up"}')
                return
            scores = []
            for sample in samples:
                response = sample["response"]
                score, length = vowel_share(response), len(response)
                s.scored.append({"score": score, "length": length, "sample": sample})
                scores.append({"score": score, "length": length})
            self._answer(200, json.dumps({"scores": scores}).encode())


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """configs/quickstart_cpu.yaml at test size (4 prompts x 4 samples a step, 3 steps, no
    validation), scored by the remote service and the judge, no rule scorer; GSM-Symbolic
    prompts."""
    work = tmp_path_factory.mktemp("remote_reward")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "prepare_gsm8k.py"),
            "--out",
            str(work / "data"),
            "--source",
            "gsm-symbolic",
            "--train-size",
            "64",
            "--test-size",
            "4",
        ],
        check=True,
        capture_output=True,
    )
    config = yaml.safe_load(QUICKSTART.read_text())
    config["model"]["path"] = str(tiny_char_llama_dir())
    config["data"].update(train_files=[str(work / "data" / "train.parquet")], train_batch_size=4)
    del config["data"]["val_files"]
    config["actor"].update(ppo_mini_batch_size=4, micro_batch_size=8)
    config["reward"] = {
        "rule_weight": 0.0,
        "remote_batch_size": 6,  # 3 requests a step, 2 at a time
        "remote_concurrency": 2,
        "remote_backoff_s": 0.2,
        "judge": {
            "model_path": str(tiny_char_judge_dir()),
            "template": JUDGE_TEMPLATE,
            "score_pattern": "([01])",
            "weight": JUDGE_WEIGHT,
            "max_tokens": 4,
        },
    }
    config["trainer"].update(total_steps=STEPS, test_freq=0, save_freq=0, loggers=["console"])
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    return work


@pytest.fixture
def service() -> Iterator[RewardService]:
    server = RewardService()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_run_trains_on_the_services_scores_exactly(work, service):
    proc = launch(work, "run", f"reward.remote_url={service.url}")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    steps = by_step(metrics(work, "run"))
    assert sorted(steps) == [1, 2, 3]
    assert service.refused == 1 and service.empty_batches >= 1  # the pre-launch check's batch
    assert len(service.scored) == STEPS * SAMPLES_PER_STEP
    for step in (1, 2, 3):
        # one step's requests all end before the next step's begin
        scored = service.scored[(step - 1) * SAMPLES_PER_STEP : step * SAMPLES_PER_STEP]
        scores = [r["score"] for r in scored]
        lengths = [r["length"] for r in scored]
        # what the judge answers to each sample's prompt (its question, then the response)
        verdicts = [float(judge_verdict("A: " + r["sample"]["response"])) for r in scored]
        totals = [s + JUDGE_WEIGHT * v for s, v in zip(scores, verdicts, strict=True)]
        m = steps[step]
        assert m["reward/mean"] == pytest.approx(sum(totals) / len(totals), rel=1e-6, abs=1e-6)
        assert m["reward/remote_mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)
        assert m["reward/judge_mean"] == pytest.approx(sum(verdicts) / len(verdicts), abs=1e-6)
        assert m["reward/judge_failures"] == 0 and m["reward/judge_unparsed"] == 0
        assert m["reward/max"] == pytest.approx(max(totals), abs=1e-6)
        assert m["reward/remote/length"] == pytest.approx(sum(lengths) / len(lengths))
        assert m["reward/remote_failures"] == 0
        assert m["reward/remote_retries"] == (1 if step == 1 else 0)  # the 503, retried
    assert len({r["score"] for r in service.scored}) > 1  # scores that differ: GRPO learns
    verdicts = {judge_verdict("A: " + r["sample"]["response"]) for r in service.scored}
    assert verdicts == {"0", "1"}  # the judge's part differs between samples too
    sample = service.scored[0]["sample"]
    assert set(sample) == {"data_source", "prompt", "response", "ground_truth", "extra_info"}
    assert sample["prompt"] and sample["ground_truth"] is not None


def test_with_no_service_listening_the_run_stops_before_training(work):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/score"
    proc = megarl_command(
        work,
        "train",
        str(work / "run.yaml"),
        f"trainer.output_dir={work / 'no_service'}",
        f"reward.remote_url={url}",
        "reward.remote_retries=1",
        "--nproc-per-node",
        "1",
    )
    assert proc.returncode == 2, proc.stdout[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"megarl: error: reward.remote_url={url} does not answer"), last
    assert "ClientConnectorError" in last and "(after 1 retries)" in last
    assert "starting 1 rank(s)" not in proc.stdout and "Traceback" not in proc.stdout
    assert not (work / "no_service" / "metrics.jsonl").exists()


def test_with_no_judge_server_listening_the_run_stops_before_training(work):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    proc = megarl_command(
        work,
        "train",
        str(work / "run.yaml"),
        f"trainer.output_dir={work / 'no_judge'}",
        "reward.judge.model_path=null",
        f"reward.judge.url={url}",
        "reward.judge.model=judge",
        "reward.judge.retries=0",
        "reward.remote_url=null",
        "--nproc-per-node",
        "1",
    )
    assert proc.returncode == 2, proc.stdout[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"megarl: error: reward.judge.url={url} does not answer GET"), last
    assert "APIConnectionError" in last and "vllm serve" in last
    assert "starting 1 rank(s)" not in proc.stdout and "Traceback" not in proc.stdout
    assert not (work / "no_judge" / "metrics.jsonl").exists()
