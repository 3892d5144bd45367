"""Every benchmark under bench/ in its --smoke size, so none rots: each must run to the end and
store its results file (figures, machine, measured matmul peaks, load, versions, commit).

The figures are not checked (benchmarks print, they do not assert); the smoke sizes take seconds.
grpo_step's and learn's smokes run megarl's side only: their TRL side needs a virtualenv that
the bench creates from the package registry on first use, which CI machines may not reach.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHES = [
    "train_step",
    "rollout",
    "grpo_step",
    "logprob",
    "reshard",
    "convert",
    "data",
    "learn",
    "arithmetic_base_rates",
    "multi_turn",
    "checkpoint_save",
    "tool_calls",
    "startup",
]
# Options smoke-run too, so that they do not rot either.
EXTRA_ARGS = {"train_step": ["--megatron-paths", "--matmuls", "3"]}
# A bench run again with options that store another file: run id -> (bench, options, file).
# agent_latency's smokes run 3 turns (half its default), on vLLM (the default) and on HF.
VARIANTS = {
    "agent_latency": ("agent_latency", ["--turns", "3"], "agent_latency_3_turns"),
    "agent_latency_hf": (
        "agent_latency",
        ["--backend", "hf", "--turns", "3"],
        "agent_latency_hf_3_turns",
    ),
}
# calculator_base_rates is not smoke-run (CI time, ~40 s): its turn loop over vLLM is the one
# multi_turn's smoke runs, and its ToolEnvironment is unit-tested.


@pytest.mark.parametrize("run", BENCHES + list(VARIANTS))
def test_bench_smoke_runs_and_stores_results(run, tmp_path):
    # grpo_step's smoke runs the tiny model; learn's the default task (2 steps of SmolLM2)
    stored = {"grpo_step": "grpo_step_tiny", "learn": "learn_arithmetic"}.get(run, run)
    bench, options, stored = VARIANTS.get(run, (run, EXTRA_ARGS.get(run, []), stored))
    env = dict(os.environ, MEGARL_BENCH_RESULTS_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        # bench/ is a package under ROOT
        [sys.executable, "-m", f"bench.{bench}", "--smoke", *options],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    record = json.loads((tmp_path / f"{stored}.smoke.json").read_text())
    assert record["bench"] == stored and record["smoke"] is True
    assert record["figures"], record
    assert record["matmul_peaks"]["fp32_gflops"] > 0 and record["matmul_peaks"]["bf16_gflops"] > 0
    assert record["machine"]["cores"] >= 1 and record["machine"]["cpu_model"]
    assert set(record["load_1min"]) == {"start", "end"}
    assert "torch" in record["versions"] and len(record["git"]["commit"]) == 40
    assert isinstance(record["git"]["dirty"], bool) and "MALLOC_MMAP_MAX_" in record["process_env"]
    if bench == "rollout":  # the sides alternate, every run stored with its load
        runs = record["figures"]["runs"]
        assert [r["side"] for r in runs] == ["vllm", "hf", "vllm", "hf"], runs
        assert all(r["tokens"] > 0 and r["load_1min"] >= 0 for r in runs), runs
    if bench == "agent_latency":  # the interface, and every side sampled the same tokens
        figures = record["figures"]
        assert figures["speedup_vs_lockstep"] > 0 and figures["loadavg_start"], figures
        assert figures["endpoint_speedup_vs_lockstep"] > 0, figures
        for case in figures["cases"]:
            sides = ("lockstep", "continuous", "endpoint")
            assert [len(figures[case]["runs"][side]) for side in sides] == [figures["repeats"]] * 3
            if run == "agent_latency_hf":  # on the HF engine a request's tokens are its own
                same = figures[case]["same_tokens_by_side"]
                assert same == {"continuous": True, "endpoint": True}
        if run == "agent_latency":  # vLLM: lock-step by calls; the others step by step
            slow = figures[figures["cases"][0]]
            assert slow["lockstep"]["engine_steps"] == 0 < slow["lockstep"]["engine_calls"]
            assert slow["continuous"]["engine_steps"] > 0 and slow["endpoint"]["engine_steps"] > 0
    if bench == "train_step":  # every side's matmuls, timed by shape
        census = record["figures"]["matmul_census"]
        assert len(census) == 3, census.keys()
        assert all(c["matmul_gflops"] > 0 and c["groups"] for c in census.values()), census
    if bench == "learn":  # the interface of its summary, and the curves' picture
        summary = record["figures"]["summary"]
        assert set(summary["megarl"]) >= {"accuracy_start", "accuracy_end"}, summary
        assert 0 <= summary["megarl"]["accuracy_end"] <= 1 and "time_to_trl_final_ratio" in summary
        # the first step ends past the smoke's budget: validated and stopped there
        curve = record["figures"]["seeds"]["1"]["runs"]["megarl"]["curve"]
        assert [p["step"] for p in curve] == [0, 1] and curve[-1]["samples"] == 4, curve
        settings = record["figures"]["settings"]
        assert settings["process_env"]["megarl"] == settings["process_env"]["trl"], settings
        assert (tmp_path / f"{stored}.smoke.png").stat().st_size > 1000
