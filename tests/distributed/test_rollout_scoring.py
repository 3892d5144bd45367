"""The trainer scores a rollout after the rollout engine sleeps, in the update's micro-batches, and
megatron's groups take the run's collective timeout. One spawn of 2 gloo ranks (PP2):

- Peak memory of the scoring pass (live tensor bytes, as ``test_plan_memory`` measures them) at a
  fixed token budget of 256 tokens per micro-batch: within 10% when the rollout grows 4x (16 -> 64
  sequences of 64 tokens, a random 4-layer model with an 8,192-token vocabulary). The same
  measurement sees one forward over the whole rollout (the old path) grow more than 2x, and both
  give the same logprobs (< 1e-5, fp32).
- A recording rollout engine inside the hybrid engine, driven by the trainer's ``step_batch``:
  the engine sleeps before the actor's first forward (the scoring pass), the actor's grad buffers
  are freed while it generates and back when the actor scores, and the step has its old logprobs
  and mismatch metrics.
- megatron's TP/PP/DP groups: megatron's 30 minutes unless given the timeout a run derives from
  ``trainer.hang_timeout_s``; then exactly that.
"""

from __future__ import annotations

import pytest

from tests.assets import tiny_char_llama_dir
from tests.config_dirs import qwen2_config_dir
from tests.distributed.scoring_workers import SIZES, scoring_worker
from tests.mp import run_gloo

TOLERANCE = 0.10


def _config_dir(root):
    return qwen2_config_dir(root, "qwen2-scoring", 8192, 128, 256)


@pytest.mark.timeout(300)
def test_scoring_after_sleep_in_bounded_micro_batches_and_group_timeouts(tmp_path):
    results = run_gloo(scoring_worker, 2, str(_config_dir(tmp_path)), str(tiny_char_llama_dir()))
    small, large = SIZES
    for rank, r in enumerate(results):
        assert set(r["default_timeouts"].values()) == {1800.0}, (rank, r["default_timeouts"])
        assert set(r["timeouts"].values()) == {r["derived_timeout"]}, (rank, r["timeouts"])

        mem = r["memory"]
        scoring, whole = mem["scoring"], mem["one_forward"]
        print(f"rank {rank}: scoring peak {scoring}, one forward {whole}, diff {mem['diff']:.2e}")
        assert scoring[large] <= (1 + TOLERANCE) * scoring[small], (rank, scoring)
        assert whole[large] > 2 * whole[small], (rank, whole)  # the measurement sees growth
        assert mem["diff"] < 1e-5, rank

        rec = r["recorded"]
        events = [e[0] for e in rec["events"]]
        print(f"rank {rank}: {events}")
        first_forward = events.index("forward")
        sleep = events.index("sleep")
        assert events.index("generate") < sleep < first_forward, events
        # nothing of the actor runs while the engine is awake (the reshard reads weights only)
        assert "forward" not in events[events.index("wake_up") : sleep], events
        generating = rec["events"][events.index("generate")]
        scoring_forward = rec["events"][first_forward]
        assert generating[1] == 0 and scoring_forward[1] > 0, rec["events"]
        assert rec["grad_bytes_after"] > 0
        assert rec["samples"] == 8  # 4 prompts x 2 samples (DP1: every rank holds them all)
        assert rec["old_finite"]
        assert rec["mismatch"]["rollout/logprob_diff_mean"] > 0.0
        for key in ("timing/rollout_s", "timing/reward_s", "timing/old_log_prob_s"):
            assert key in rec["metrics"], (key, rec["metrics"])
