"""Run tracking: MLflow (params, per-step metrics, validation tables) and a console progress line.

Only global rank 0 talks to MLflow; every metric it logs is already reduced over ranks.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

from megarl.config import RunConfig, to_flat_dict


class Tracker:
    def __init__(self, cfg: RunConfig, rank: int, run_id: str | None = None):
        self.enabled = rank == 0
        self.cfg = cfg
        self.run_id = run_id
        self.t_start = time.perf_counter()
        if not self.enabled:
            return
        import mlflow

        # MLflow's file store is frozen; a local SQLite file is its recommended default.
        uri = cfg.trainer.mlflow_tracking_uri or f"sqlite:///{Path('mlflow.db').absolute()}"
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(cfg.trainer.experiment)
        run = mlflow.start_run(run_id=run_id, run_name=cfg.trainer.run_name)
        self.run_id = run.info.run_id
        if run_id is None:
            params = {k: str(v)[:500] for k, v in to_flat_dict(cfg).items()}
            mlflow.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        import json

        import mlflow

        out = Path(self.cfg.trainer.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

        clean = {
            k.replace("@", "_"): float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))
        }
        mlflow.log_metrics(clean, step=step)

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        if not self.enabled or not rows:
            return
        import mlflow

        columns = {k: [r[k] for r in rows] for k in rows[0]}
        mlflow.log_table(columns, artifact_file=name)

    def progress(self, step: int, total: int, metrics: dict[str, float], first_step: int) -> None:
        if not self.enabled:
            return
        done = step - first_step + 1
        elapsed = time.perf_counter() - self.t_start
        eta = elapsed / max(done, 1) * (total - step - 1)
        keys = (
            "reward/mean",
            "actor/pg_loss",
            "actor/kl_loss",
            "critic/vf_loss",
            "rm/loss",
            "rm/accuracy",
            "perf/step_s",
        )
        shown = "  ".join(f"{k.split('/')[-1]}={metrics[k]:.4g}" for k in keys if k in metrics)
        bar_len = 20
        filled = int(bar_len * (step + 1) / total)
        bar = "#" * filled + "." * (bar_len - filled)
        print(
            f"[{bar}] step {step + 1}/{total}  {shown}  eta {eta:.0f}s", file=sys.stderr, flush=True
        )

    def close(self) -> None:
        if self.enabled:
            import mlflow

            mlflow.end_run()
