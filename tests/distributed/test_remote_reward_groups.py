"""A remote reward service and a judge at an OpenAI-compatible server are asked once per
model-parallel group: at TP2 on 2 gloo ranks, the first rank asks and both train on its answer,
even from a service or judge that scores the same samples differently each time it is asked
(here: by how many requests it has seen)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.mp import run_gloo


class CountingService(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), CountingHandler)
        self.requests = 0
        self.judged = 0  # chat completions (the judge's)
        self.lock = threading.Lock()


class CountingHandler(BaseHTTPRequestHandler):
    server: CountingService

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/chat/completions":
            with self.server.lock:
                self.server.judged += 1
                seen = self.server.judged
            message = {"role": "assistant", "content": f"Score: {seen}"}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            answer = {"id": "c", "object": "chat.completion", "created": 0, "model": "judge"}
            self._send(json.dumps({**answer, "choices": [choice]}).encode())
            return
        samples = request["samples"]
        with self.server.lock:
            self.server.requests += 1
            seen = self.server.requests
        self._send(json.dumps({"scores": [seen + k / 10 for k in range(len(samples))]}).encode())

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def remote_scores_worker(rank: int, world: int, url: str) -> tuple[list[float], list[float]]:
    import torch

    from megarl.config import JudgeConfig
    from megarl.data import PromptItem
    from megarl.parallel import ParallelLayout, initialize_model_parallel
    from megarl.platform import adapt_megatron_for_cpu
    from megarl.rewards.judge import JudgeScorer
    from megarl.rewards.judge_prompt import JudgeTemplate
    from megarl.rewards.judge_remote import OpenAIJudge
    from megarl.rewards.remote import RemoteScorer
    from megarl.rewards.remote_settings import RemoteSettings
    from megarl.rollout.rollout_batch import replies_batch
    from megarl.rollout.rollout_types import RolloutOutput
    from megarl.trainer.experience import batch_scores

    adapt_megatron_for_cpu()
    initialize_model_parallel(ParallelLayout(tp=2))
    output = RolloutOutput(
        prompt_index=[0, 0, 0],
        token_ids=[[1], [2], [3]],
        logprobs=[[-0.1]] * 3,
        finish_reasons=["stop"] * 3,
    )
    batch = replies_batch([[5]], output)
    item = PromptItem(uid=0, input_ids=[5], prompt="q", data_source="d", ground_truth="1")
    remote = RemoteScorer(RemoteSettings(f"{url}/score", batch_size=2))
    texts, cpu = ["a", "b", "c"], torch.device("cpu")
    scores, _, _ = batch_scores(remote, [item], batch, texts, cpu, [0, 1, 2])
    settings = JudgeConfig(url=f"{url}/v1", model="judge", concurrency=1)
    judge = JudgeScorer(JudgeTemplate.from_config(settings), OpenAIJudge(settings))
    judged, _, _ = batch_scores(judge, [item], batch, texts, cpu, [0, 1, 2])
    return scores.tolist(), judged.tolist()


def test_the_model_parallel_group_asks_once_and_shares_the_answer():
    service = CountingService()
    threading.Thread(target=service.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{service.server_address[1]}"
        (first, first_judged), (second, second_judged) = run_gloo(remote_scores_worker, 2, url)
    finally:
        service.shutdown()
        service.server_close()
    assert service.requests == 2  # two batches (batch size 2), asked by one rank only
    assert first == second
    # either batch may come first
    assert any(sorted(first) == pytest.approx(s) for s in ([1, 1.1, 2], [1, 2, 2.1]))
    assert service.judged == 3  # one completion per sample, asked by one rank only
    assert first_judged == second_judged == [1.0, 2.0, 3.0]  # one at a time: in order
