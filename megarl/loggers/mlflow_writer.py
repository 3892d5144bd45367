"""The MLflow writer: the process that holds a run's MLflow connection (``python -m
megarl.loggers.mlflow_writer``, started by :class:`megarl.loggers.mlflow_logger.MlflowLogger`).

Why a process of its own: importing MLflow and opening its store (SQLAlchemy, the schema check of
a SQLite file, the experiment lookup) costs 1.5-3 s of CPU, paid on the training rank's critical
path before the first step. Here it runs beside the rank's own start-up, on another core, and the
rank imports neither MLflow nor SQLAlchemy.

The protocol is one JSON object per line: commands on stdin, replies on the protocol stream (the
process's original stdout; anything MLflow prints goes to stderr instead):

- ``{"op": "start", "uri", "experiment", "run_name", "resume_run_id", "params", "verbose"}``
  -> ``{"run_id": ..., "note": ...}`` or ``{"error": ...}``
- ``{"op": "metrics", "metrics": {...}, "step": N}`` and ``{"op": "table", "columns": {...},
  "name": ..., "step": N}``: no reply; steps the resumed MLflow run already holds are skipped
- ``{"op": "end"}`` -> ``{"ended": true}``; the run ends FINISHED.

End of input without ``end`` (the rank died) ends the run FAILED. An error after the start is
written to stderr and ends the process with exit code 1; the logger reports it at its next call.
Once the run has ended (every metric written, the run marked), the process exits without the
interpreter's teardown (megarl.process_exit): the logger's close waits for that exit, and the
teardown took about 1 s after a run's last line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import IO

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from megarl.process_exit import end_process

# the tag of a new MLflow run that continues a resumed run its store does not hold: the old run id
RESUMED_FROM_TAG = "megarl.resumed_from_run_id"


def mlflow_metric_name(key: str) -> str:
    return key.replace("@", "_")  # MLflow refuses '@' in metric names (e.g. pass@k)


def last_logged_step(run_id: str) -> int:
    """The largest step any metric of the MLflow run ``run_id`` was logged at (-1: none)."""
    client = MlflowClient()
    keys = client.get_run(run_id).data.metrics
    steps = (m.step for key in keys for m in client.get_metric_history(run_id, key))
    return max(steps, default=-1)


def _run_exists(run_id: str) -> bool:
    try:
        MlflowClient().get_run(run_id)
    except MlflowException:
        return False
    return True


class Writer:
    """One MLflow run, fed by commands."""

    def __init__(self, reply: IO[str]):
        self.reply = reply
        self.logged_through = -1

    def send(self, message: dict[str, object]) -> None:
        self.reply.write(json.dumps(message) + "\n")
        self.reply.flush()

    def start(self, cmd: dict) -> None:
        if not cmd["verbose"]:  # database set-up and experiment creation are INFO chatter
            for name in ("mlflow", "alembic"):
                logging.getLogger(name).setLevel(logging.WARNING)
        mlflow.set_tracking_uri(cmd["uri"])
        mlflow.set_experiment(cmd["experiment"])
        resumed, note = cmd["resume_run_id"], None
        if resumed is not None and not _run_exists(resumed):
            # the run folder moved to another machine, or the store is new: its run is not here
            note = (
                f"MLflow: the tracking store {cmd['uri']} has no run {resumed} (the run folder "
                "was moved, or the store is another one): the resumed steps go to a new MLflow "
                f"run, tagged {RESUMED_FROM_TAG}={resumed}; metrics.jsonl keeps the whole history"
            )
        new_run = resumed is None or note is not None
        run = mlflow.start_run(run_id=None if new_run else resumed, run_name=cmd["run_name"])
        if note is not None:  # the new run names the one it continues
            mlflow.set_tag(RESUMED_FROM_TAG, resumed)
        # MLflow keeps every value logged for a step: the steps a resumed run redoes (those after
        # its checkpoint that the run which stopped had logged) are skipped, not logged twice.
        self.logged_through = -1 if new_run else last_logged_step(run.info.run_id)
        if new_run:
            mlflow.log_params({k: v[:500] for k, v in cmd["params"].items()})
        self.send({"run_id": run.info.run_id, "note": note})

    def metrics(self, cmd: dict) -> None:
        if cmd["step"] > self.logged_through and cmd["metrics"]:
            clean = {mlflow_metric_name(k): float(v) for k, v in cmd["metrics"].items()}
            mlflow.log_metrics(clean, step=cmd["step"])

    def table(self, cmd: dict) -> None:
        if cmd["step"] > self.logged_through:
            mlflow.log_table(cmd["columns"], artifact_file=cmd["name"])


def serve(commands: IO[str], reply: IO[str]) -> int:
    writer = Writer(reply)
    started = False
    for line in commands:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "start":
            try:
                writer.start(cmd)
            except Exception as e:  # the store cannot be reached or refused the run
                writer.send({"error": f"{type(e).__name__}: {e}"})
                return 1
            started = True
        elif op == "metrics":
            writer.metrics(cmd)
        elif op == "table":
            writer.table(cmd)
        elif op == "end":
            mlflow.end_run()
            writer.send({"ended": True})
            return 0
    if started:
        mlflow.end_run(status="FAILED")  # the rank ended without closing its logger
    return 0


def main() -> int:
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever MLflow prints goes to stderr, never into the protocol stream
    try:
        return serve(sys.stdin, reply)
    except Exception as e:
        print(f"megarl's MLflow writer stopped: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    end_process(main(), exit_handlers=True)
