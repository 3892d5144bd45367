"""The flagship recipe's launcher, scripts/run_qwen7b_grpo.sh, in its CPU smoke mode.

One run of the unchanged script (MEGARL_SMOKE=1): GSM-Symbolic data prepared offline, a tiny
model, GRPO for 2 steps at TP1 x PP2 x DP2 with vLLM at TP2 on 4 local ranks and the recipe's
recompute. Two extra overrides, as users pass them: step 2 is profiled, and the toy vowel-rate
reward replaces the GSM8K scorer (a random model scores 0 on GSM8K, so every GRPO advantage and
gradient would be zero and the update at this layout would go untested).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_mode_runs_the_grpo_recipe(tmp_path):
    out = tmp_path / "smoke"
    env = dict(os.environ, MEGARL_SMOKE="1", OUTPUT_DIR=str(out), PYTHON=sys.executable)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for name in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "GPUS_PER_NODE", "CONFIG"):
        env.pop(name, None)
    for name in ("MODEL_PATH", "DATA_DIR", "DATA_SOURCE"):
        env.pop(name, None)
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "run_qwen7b_grpo.sh"),
            "trainer.profile_steps=[2]",
            "reward.custom_fn=megarl.rewards.toy:vowel_rate",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    assert "parallel.tp=1 parallel.pp=2 parallel.infer_tp=2" in proc.stderr  # it prints the command

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "actor/pg_loss" in r}
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

    client = mlflow.tracking.MlflowClient(env["MLFLOW_TRACKING_URI"])
    [run] = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2]
    assert run.data.params["algorithm.adv_estimator"] == "grpo"
    assert run.data.params["model.recompute"] == "full"
