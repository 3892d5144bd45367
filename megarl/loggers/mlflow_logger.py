"""The MLflow logger: settings as params, metrics per step, validation tables as artifacts."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from megarl.loggers.base import Logger, Row, TrackingSettings, register


def default_tracking_uri() -> str:
    # MLflow's file store is frozen; a local SQLite file is its recommended default.
    return f"sqlite:///{Path('mlflow.db').absolute()}"


def mlflow_metric_name(key: str) -> str:
    return key.replace("@", "_")  # MLflow refuses '@' in metric names (e.g. pass@k)


def last_logged_step(run_id: str) -> int:
    """The largest step any metric of the MLflow run ``run_id`` was logged at (-1: none)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    keys = client.get_run(run_id).data.metrics
    steps = (m.step for key in keys for m in client.get_metric_history(run_id, key))
    return max(steps, default=-1)


@register("mlflow", package="mlflow")
class MlflowLogger(Logger):
    def __init__(self, settings: TrackingSettings):
        import mlflow

        if not settings.verbose:  # database set-up and experiment creation are INFO chatter
            for name in ("mlflow", "alembic"):
                logging.getLogger(name).setLevel(logging.WARNING)
        self._mlflow = mlflow
        mlflow.set_tracking_uri(settings.mlflow_tracking_uri or default_tracking_uri())
        mlflow.set_experiment(settings.experiment)
        resumed = settings.run_ids.get("mlflow")
        run = mlflow.start_run(run_id=resumed, run_name=settings.run_name)
        self.run_id = run.info.run_id
        # MLflow keeps every value logged for a step: the steps a resumed run redoes (those after
        # its checkpoint that the run which stopped had logged) are skipped, not logged twice.
        self.logged_through = -1 if resumed is None else last_logged_step(run.info.run_id)
        if resumed is None:
            mlflow.log_params({k: v[:500] for k, v in settings.params.items()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step <= self.logged_through:
            return
        clean = {
            mlflow_metric_name(k): float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))
        }
        self._mlflow.log_metrics(clean, step=step)

    def log_table(self, rows: list[Row], name: str, step: int) -> None:
        if rows and step > self.logged_through:
            columns = {k: [r[k] for r in rows] for k in rows[0]}
            self._mlflow.log_table(columns, artifact_file=name)

    def close(self) -> None:
        self._mlflow.end_run()
