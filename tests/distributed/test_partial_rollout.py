"""Partial rollouts (rollout.placement.partial): a weight update lands in the middle of a generation in the
real CPU vLLM engine (tests/distributed/partial_rollout_worker.py, one process) and the recorded
per-token versions and logprobs are checked against the engine's weights of each version.

- the first round (6 tokens) is version 0, the rest version 1: nothing was thrown away, the
  first round's tokens are those a version-0-only generation with the same seeds samples;
- each token's logprob is what transformers gives that token, teacher-forced at the sampling
  temperature, under the weights of the token's version (1e-4: vLLM's CPU kernels against
  transformers' in fp32, measured ~1e-6), and far from the other version's.

The same launch drives the engine step by step (megarl.rollout.step_loop, issue 47): two requests
join a running one after its third step and finish while it runs on; every request samples the
tokens one ``generate`` call of the three samples, with transformers' logprobs (1e-4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.assets import tiny_char_llama_dir

WORKER = Path(__file__).with_name("partial_rollout_worker.py")
ROOT = Path(__file__).resolve().parents[2]
CHUNK, NEW_TOKENS = 6, 20


@pytest.fixture(scope="module")
def result() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tiny_char_llama_dir())],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT="))


def test_tokens_keep_the_version_and_logprobs_they_were_sampled_with(result):
    samples = result["samples"]
    assert len(samples) == 6 and result["rounds"] == -(-NEW_TOKENS // CHUNK)
    assert result["calls"] == [True] * (result["rounds"] - 1)
    for s in samples:
        assert len(s["tokens"]) == NEW_TOKENS and s["finish"] == "length"
        assert s["versions"] == [0] * CHUNK + [1] * (NEW_TOKENS - CHUNK)
        assert s["tokens"][:CHUNK] == s["only_v0_tokens"][:CHUNK]
        for lp, version, r0, r1 in zip(
            s["logprobs"], s["versions"], s["ref_v0"], s["ref_v1"], strict=True
        ):
            own = r0 if version == 0 else r1
            assert abs(lp - own) < 1e-4, (version, lp, own)
        # the two versions' logprobs differ: the check above tells them apart
        assert max(abs(a - b) for a, b in zip(s["ref_v0"], s["ref_v1"], strict=True)) > 0.1
    # the update changed what was sampled after it (the version-0 run went on differently)
    assert any(s["tokens"][CHUNK:] != s["only_v0_tokens"][CHUNK:] for s in samples)


def test_requests_join_a_running_batch_step_by_step_and_sample_as_one_call_does(result):
    long, short, mid = result["step_loop"]
    assert [len(r["tokens"]) for r in (long, short, mid)] == [30, 4, 10]
    assert long["joined_at_step"] == 0 and short["joined_at_step"] == mid["joined_at_step"] == 3
    # they joined the running request and finished while it ran on, one token a step
    assert short["finished_after_steps"] == 3 + 4 and mid["finished_after_steps"] == 3 + 10
    assert long["finished_after_steps"] == 30
    for r in (long, short, mid):
        assert r["tokens"] == r["one_call_tokens"] and r["finish"] == "length"
        assert max(abs(a - b) for a, b in zip(r["logprobs"], r["ref"], strict=True)) < 1e-4
