"""The MLflow logger: settings as params, metrics per step, validation tables as artifacts.

MLflow itself runs in a writer process (megarl/loggers/mlflow_writer.py) that this logger starts
and feeds through a pipe, so its import and store set-up overlap the rank's start-up instead of
delaying the first step. The run id is read when first needed (checkpoints, tracking_ids.json);
closing the logger waits until every metric is written and the run has ended.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import IO

from megarl.child_wait import wait_for_exit
from megarl.loggers.base import Logger, Row, TrackingSettings, register

# Ending the run flushes nothing slow (every metric was written as it came); a writer that takes
# longer than this is stuck (a tracking server that stopped answering).
CLOSE_TIMEOUT_S = 120.0


def default_tracking_uri() -> str:
    # MLflow's file store is frozen; a local SQLite file is its recommended default.
    return f"sqlite:///{Path('mlflow.db').absolute()}"


class MlflowWriterError(RuntimeError):
    """The MLflow writer process failed; the message says why and what to change."""


@register("mlflow", package="mlflow")
class MlflowLogger(Logger):
    def __init__(self, settings: TrackingSettings):
        self._uri = settings.mlflow_tracking_uri or default_tracking_uri()
        # its own import profile would mix into the rank's on the shared stderr (bench.startup)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPROFILEIMPORTTIME"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "megarl.loggers.mlflow_writer"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._run_id: str | None = None
        self._closed = False
        self._send(
            {
                "op": "start",
                "uri": self._uri,
                "experiment": settings.experiment,
                "run_name": settings.run_name,
                "resume_run_id": settings.run_ids.get("mlflow"),
                "params": settings.params,
                "verbose": settings.verbose,
            }
        )

    def _pipe(self) -> IO[str]:
        stdin = self._proc.stdin
        assert stdin is not None  # opened with stdin=PIPE
        return stdin

    def _failed(self) -> MlflowWriterError:
        code = self._proc.poll()
        return MlflowWriterError(
            f"MLflow logging to {self._uri} stopped (the writer process exited with "
            f"{code}; its message is above). Fix the store or set trainer.mlflow_tracking_uri, or "
            "drop mlflow from trainer.loggers (metrics.jsonl keeps every metric either way)"
        )

    def _send(self, message: dict[str, object]) -> None:
        try:
            self._pipe().write(json.dumps(message) + "\n")
            self._pipe().flush()
        except (BrokenPipeError, ValueError):
            raise self._failed() from None

    def _reply(self) -> dict:
        stdout = self._proc.stdout
        assert stdout is not None  # opened with stdout=PIPE
        line = stdout.readline()
        if not line:
            self._proc.wait()
            raise self._failed()
        reply: dict = json.loads(line)
        if "error" in reply:
            self._proc.wait()
            raise MlflowWriterError(
                f"MLflow could not start a run at {self._uri}: {reply['error']}. Fix the store "
                "or set trainer.mlflow_tracking_uri (or =none to log without MLflow)"
            )
        return reply

    @property
    def run_id(self) -> str:  # type: ignore[override]
        """The MLflow run's id; the first call waits until the writer has started the run."""
        if self._run_id is None:
            reply = self._reply()
            self._run_id = str(reply["run_id"])
            if reply.get("note"):
                print(f"megarl: warning: {reply['note']}", file=sys.stderr, flush=True)
        return self._run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        clean = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))
        }
        self._send({"op": "metrics", "metrics": clean, "step": step})

    def log_table(self, rows: list[Row], name: str, step: int) -> None:
        if rows:
            columns = {k: [r[k] for r in rows] for k in rows[0]}
            self._send({"op": "table", "columns": columns, "name": name, "step": step})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.run_id  # noqa: B018 - a start error surfaces here, not as a broken pipe
        self._send({"op": "end"})
        self._pipe().close()
        self._reply()
        code = wait_for_exit(self._proc, CLOSE_TIMEOUT_S)  # its exit is prompt: not polled
        if code is None:
            self._proc.kill()
            raise MlflowWriterError(
                f"MLflow did not end its run at {self._uri} within {CLOSE_TIMEOUT_S:.0f} s "
                "(metrics.jsonl holds every metric)"
            )
        if code != 0:
            raise self._failed()
