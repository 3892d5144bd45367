"""Run tracking: each step's metrics to ``OUTPUT/metrics.jsonl`` and to the loggers named in
``trainer.loggers`` (console, MLflow, TensorBoard, W&B; see megarl/loggers/).

Only global rank 0 writes; every metric it gets is already reduced over ranks. metrics.jsonl is
always written (``megarl report`` draws from it), whatever the loggers, and so are tables (the
validation generations, ``OUTPUT/validation/step_<step>.json``). A resumed run holds each
step once everywhere: metrics.jsonl is cut back to the checkpoint's step, TensorBoard purges the
later events, MLflow and W&B skip the steps their run already has.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from megarl.config import RunConfig, to_flat_dict
from megarl.console import is_verbose
from megarl.files import append_text, replace_file
from megarl.loggers import (
    Logger,
    Progress,
    Row,
    TrackingSettings,
    active_loggers,
    build_loggers,
    check_loggers,
)

RUN_IDS_FILE = "tracking_ids.json"  # logger name -> run id, so that a resumed run continues it
METRICS_FILE = "metrics.jsonl"


def default_run_name(experiment: str, now: float | None = None) -> str:
    """``<experiment>-YYYYmmdd-HHMMSS``: the run's name when trainer.run_name is not set."""
    return f"{experiment}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"


def cut_metrics(path: Path, step: int) -> int:
    """Drop the lines of ``path`` (metrics.jsonl) logged after ``step``, rewriting it atomically;
    returns how many went. A run resumed after ``step`` logs those steps again, so each step stays
    in the file once. (A fresh run, step 0, starts in a folder without one: see run/output_dir.)"""
    if step <= 0 or not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    keep = [line for line in lines if _line_step(line) <= step]
    if len(keep) == len(lines):
        return 0
    replace_file(path, "".join(keep))
    return len(lines) - len(keep)


def _line_step(line: str) -> float:
    try:
        step = json.loads(line).get("step", 0)
    except (ValueError, AttributeError):
        return float("inf")  # a line cut off by a crash mid-write: dropped
    return step if isinstance(step, (int, float)) else float("inf")


def table_step(rows: list[Row], name: str) -> int:
    """The step a table belongs to: its rows' ``step`` column (validation tables have one)."""
    step = rows[0].get("step", 0) if rows else 0
    return int(step) if isinstance(step, (int, float)) else 0


class Tracker:
    def __init__(
        self, cfg: RunConfig, rank: int, mlflow_run_id: str | None = None, start_step: int = 0
    ):
        self.enabled = rank == 0
        self.cfg = cfg
        self._mlflow_run_id = mlflow_run_id
        self._ids_written = False
        self.t_start = time.perf_counter()
        self.output_dir = Path(cfg.trainer.output_dir)
        self.loggers: dict[str, Logger] = {}
        if not self.enabled:
            return
        t = cfg.trainer
        check_loggers(t.loggers, t.mlflow_tracking_uri)
        run_ids = self._saved_run_ids() if start_step or mlflow_run_id else {}
        if mlflow_run_id is not None:
            run_ids["mlflow"] = mlflow_run_id
        # Steps after the checkpoint were logged by the run that stopped: they run again now.
        cut_metrics(self.output_dir / METRICS_FILE, start_step)
        settings = TrackingSettings(
            output_dir=self.output_dir,
            experiment=t.experiment,
            # A fresh run is named (the services' own name generators follow the seeded RNG and
            # give every run the same name); a resumed one keeps its name unless one is set.
            run_name=t.run_name or (None if run_ids else default_run_name(t.experiment)),
            params={k: str(v) for k, v in to_flat_dict(cfg).items()},
            mlflow_tracking_uri=t.mlflow_tracking_uri,
            wandb_mode=t.wandb_mode,
            verbose=is_verbose(),
            resume_step=start_step,
            run_ids=run_ids,
        )
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = build_loggers(active_loggers(t.loggers, t.mlflow_tracking_uri), settings)

    @property
    def mlflow_run_id(self) -> str | None:
        """MLflow's run id: kept in checkpoints (their trainer state's mlflow_run_id) and in
        RUN_IDS_FILE beside every other logger's. Reading it waits for MLflow's writer to have
        started the run (see megarl/loggers/mlflow_logger.py)."""
        if "mlflow" in self.loggers:
            return self.loggers["mlflow"].run_id
        return self._mlflow_run_id

    def begin(self) -> None:
        """Called before the first step (and by the first log, whichever comes first): waits
        for every logger's run (MLflow's writer, started beside the models' build, has had that
        time), so that a tracking store that cannot be used stops the run before any step, and
        records the run ids in RUN_IDS_FILE for a resumed run to continue."""
        if not self.enabled or self._ids_written:
            return
        self._ids_written = True
        ids = {name: lg.run_id for name, lg in self.loggers.items() if lg.run_id is not None}
        replace_file(self.output_dir / RUN_IDS_FILE, json.dumps(ids) + "\n")

    def _saved_run_ids(self) -> dict[str, str]:
        path = self.output_dir / RUN_IDS_FILE
        return dict(json.loads(path.read_text())) if path.is_file() else {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        self.begin()
        append_text(self.output_dir / METRICS_FILE, json.dumps({"step": step, **metrics}) + "\n")
        for logger in self.loggers.values():
            logger.log_metrics(metrics, step)

    def log_table(self, rows: list[Row], name: str, step: int | None = None) -> None:
        if not self.enabled or not rows:
            return
        at = table_step(rows, name) if step is None else step
        target = self.output_dir / name  # names are megarl's own, e.g. validation/step_000010.json
        target.parent.mkdir(parents=True, exist_ok=True)
        replace_file(target, json.dumps(rows, indent=1) + "\n")
        for logger in self.loggers.values():
            logger.log_table(rows, name, at)

    def progress(self, step: int, total: int, metrics: dict[str, float], first_step: int) -> None:
        """``step`` is 0-based here (the loop's index); the console shows it 1-based."""
        if not self.enabled:
            return
        done = step - first_step + 1
        elapsed = time.perf_counter() - self.t_start
        eta = elapsed / max(done, 1) * (total - step - 1)
        p = Progress(step=step + 1, total=total, metrics=metrics, eta_s=eta)
        for logger in self.loggers.values():
            logger.progress(p)

    def close(self) -> None:
        self.begin()
        for logger in self.loggers.values():
            logger.close()
