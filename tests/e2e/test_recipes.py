"""The CPU recipes as users run them.

The flagship recipe's launcher, scripts/run_qwen7b_grpo.sh, in its CPU smoke mode: one run of the unchanged script (MEGARL_SMOKE=1): GSM-Symbolic data prepared offline, a tiny
model, GRPO for 2 steps at TP1 x PP2 x DP2 with vLLM at TP2 on 4 local ranks and the recipe's
recompute. Two extra overrides, as users pass them: step 2 is profiled, and the toy vowel-rate
reward replaces the GSM8K scorer (a random model scores 0 on GSM8K, so every GRPO advantage and
gradient would be zero and the update at this layout would go untested).

configs/smollm2_gsm_cpu.yaml (the real SmolLM2-135M-Instruct learning GSM-Symbolic problems) for 2
steps: prepared by `python -m megarl.quickstart --recipe gsm`, as `make learn-gsm` does, and run at
tiny sizes (2 prompts x 2 samples x 24 tokens, 8 validation problems) through the same model,
data and scorer. Whether it learns is bench/learn.py's to measure, not a test's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal where CUDA is absent"
)
def test_gpu_recipe_without_cuda_is_refused_naming_the_ways_out(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MEGARL_SMOKE", "CONFIG")}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_qwen7b_grpo.sh")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "is a GPU recipe" in proc.stderr and "sees no CUDA device" in proc.stderr
    assert "MEGARL_SMOKE=1" in proc.stderr and "--dry-run" in proc.stderr
    assert "prepare_gsm8k" not in proc.stderr  # refused before preparing anything


@dataclass(frozen=True)
class SmokeRun:
    proc: subprocess.CompletedProcess
    out: Path  # its OUTPUT_DIR
    steps: dict[int, dict]  # metrics.jsonl's step records
    tracking_uri: str


def smoke_run(tmp_path: Path, name: str, *overrides: str, config: str | None = None) -> SmokeRun:
    """The flagship script, unchanged, at smoke size (MEGARL_SMOKE=1) on its default config or
    ``config``, with ``overrides`` as a user passes them; the run must succeed."""
    out = tmp_path / name
    env = dict(os.environ, MEGARL_SMOKE="1", OUTPUT_DIR=str(out), PYTHON=sys.executable)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / (name + '.db')}"
    for variable in (
        *("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "GPUS_PER_NODE", "CONFIG"),
        *("MODEL_PATH", "DATA_DIR", "DATA_SOURCE"),
    ):
        env.pop(variable, None)
    if config is not None:
        env["CONFIG"] = str(ROOT / config)
    script = str(ROOT / "scripts" / "run_qwen7b_grpo.sh")
    proc = subprocess.run(
        ["bash", script, *overrides],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "actor/pg_loss" in r}
    return SmokeRun(proc, out, steps, env["MLFLOW_TRACKING_URI"])


def test_smoke_mode_runs_the_grpo_recipe(tmp_path):
    run = smoke_run(
        tmp_path,
        "smoke",
        "trainer.profile_steps=[2]",
        "reward.custom_fn=megarl.rewards.toy:vowel_rate",
    )
    proc, out, steps = run.proc, run.out, run.steps
    assert "parallel.tp=1 parallel.pp=2 parallel.infer_tp=2" in proc.stderr  # it prints the command
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        for key in ("actor/pg_loss", "actor/kl_loss", "reward/mean"):
            assert math.isfinite(record[key]), (key, record)
        assert record["reward/std"] > 0 and record["actor/grad_norm"] > 0  # a real update
        assert record["actor/update_ok"] == 1.0
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert (out / "checkpoints" / "step_00000002" / "actor").is_dir()

    # trainer.profile_steps=[2]: one Chrome trace per rank for step 2, none for step 1.
    traces = sorted(p.name for p in (out / "profile").iterdir())
    assert traces == [f"step_2_rank{r}.json" for r in range(4)], traces
    trace = json.loads((out / "profile" / "step_2_rank0.json").read_text())
    events = trace["traceEvents"]
    assert len(events) > 100 and any(e.get("ph") == "X" for e in events)

    import mlflow

    client = mlflow.tracking.MlflowClient(run.tracking_uri)
    [tracked] = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    history = client.get_metric_history(tracked.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2]
    assert tracked.data.params["algorithm.adv_estimator"] == "grpo"
    assert tracked.data.params["model.recompute"] == "full"


def test_moe_recipe_smoke_with_routing_replay_trains_on_the_rollouts_experts(tmp_path):
    """The MoE recipe's smoke run (tiny Qwen3-MoE at EP2, 2 steps) with and without
    actor.router_replay, its rollout in bf16 against the fp32 trainer, so that the engine's
    routers flip near-ties the trainer's do not (the mismatch replay is for). Without replay part
    of the token-layers use other experts than the rollout's and their tokens' logprobs move; with
    it every recorded token-layer uses the rollout's experts and step 1 (the same samples in both
    runs: same weights, same seeds) has no larger mismatch, max or mean. Measured (EPYC): agreement
    0.994 -> 1; step 1's max 0.20 -> 0.017 (without replay the max is a flipped token's), mean
    0.0056 -> 0.0043 (the rest is bf16 rounding)."""
    config = "configs/grpo_qwen3_30b_a3b.yaml"
    runs = {
        replay: smoke_run(
            tmp_path,
            f"replay_{replay}",
            f"actor.router_replay={replay}",
            "rollout.engine.dtype=bfloat16",
            config=config,
        ).steps
        for replay in ("true", "false")
    }
    print(
        {
            k: {s: {m: v for m, v in r.items() if "moe" in m} for s, r in run.items()}
            for k, run in runs.items()
        }
    )
    replayed, natural = runs["true"], runs["false"]
    assert sorted(replayed) == sorted(natural) == [1, 2]
    for step in (1, 2):
        assert replayed[step]["moe/routing_agreement"] == 1.0, replayed[step]
        assert replayed[step]["moe/recorded_token_layers"] > 0
        assert replayed[step]["actor/update_ok"] == 1.0
        assert natural[step]["moe/routing_agreement"] < 1.0, natural[step]
    # step 1: the same samples; the flipped tokens' mismatch is what replay removes
    one, other = replayed[1], natural[1]
    assert one["moe/recorded_token_layers"] == other["moe/recorded_token_layers"]
    mean, top = "rollout/moe_logprob_diff_mean", "rollout/moe_logprob_diff_max"
    assert one[mean] <= other[mean], (one[mean], other[mean])
    # the max is one token's: where no response token flipped (another CPU's bf16 may flip
    # others), replay's forward still moves the bf16 rounding of the max by a few percent
    assert one[top] <= other[top] * 1.05, (one[top], other[top])


def test_smollm2_gsm_recipe_runs_two_steps_with_validation(tmp_path):
    out = tmp_path / "learn_gsm"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("MASTER_PORT", None)
    prep = subprocess.run(
        [sys.executable, "-m", "megarl.quickstart", "--recipe", "gsm", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert prep.returncode == 0, (prep.stdout[-3000:], prep.stderr[-3000:])
    assert (out / "model" / "model.safetensors").is_file()
    import pyarrow.parquet as pq

    test = pq.read_table(out / "data" / "test.parquet").to_pylist()
    assert len(test) == 64 and {r["data_source"] for r in test} == {"openai/gsm8k"}
    pq.write_table(
        pq.read_table(out / "data" / "test.parquet").slice(0, 8), tmp_path / "val.parquet"
    )

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl.cli",
            "train",
            str(ROOT / "configs" / "smollm2_gsm_cpu.yaml"),
            f"model.path={out / 'model'}",
            f"data.train_files=[{out / 'data' / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'val.parquet'}]",
            "data.train_batch_size=2",
            "data.val_batch_size=8",
            "rollout.sampling.n=2",
            "rollout.sampling.max_response_length=24",
            "actor.ppo_mini_batch_size=2",
            "actor.micro_batch_size=4",
            "trainer.total_steps=2",
            "trainer.test_freq=2",
            "trainer.val_before_train=false",
            f"trainer.output_dir={out / 'run'}",
            "trainer.mlflow_tracking_uri=none",
            "trainer.loggers=[console]",
            "--nproc-per-node",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    by_step: dict[int, dict] = {}
    for line in (out / "run" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        by_step.setdefault(rec["step"], {}).update(rec)
    assert sorted(by_step) == [1, 2]
    for record in by_step.values():
        assert math.isfinite(record["actor/pg_loss"]) and record["actor/update_ok"] == 1.0
        assert 0.0 <= record["reward/mean"] <= 1.0  # the GSM8K score with its 0.1 format credit
        assert record["response/length_mean"] <= 24
    val = by_step[2]
    assert val["val/openai/gsm8k/prompts"] == 8.0
    # accuracy (correct answers) <= score (correct 1, wrong but formatted 0.1)
    assert 0.0 <= val["val/openai/gsm8k/pass@1"] <= val["val/openai/gsm8k/mean@1"] <= 1.0
    assert (out / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000002"
