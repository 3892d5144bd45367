"""The loggers of trainer.loggers fed a fake metrics stream, read back with each tool's own reader
(TensorBoard's EventAccumulator; W&B's offline run file, parsed without a network)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

from megarl.config import RunConfig, TrainerConfig, load_config
from megarl.errors import ConfigError
from megarl.loggers import Progress, active_loggers, check_loggers
from megarl.loggers import base as logger_base
from megarl.loggers.console import progress_line
from megarl.run.checks import check_choices
from megarl.run.tracking import RUN_IDS_FILE, Tracker
from tests.wandb_records import history

pytestmark = pytest.mark.unit

STEPS = 3
TABLE = [
    {"step": 2, "prompt": "What is 2 | 3?", "response": "five\nor so", "score": 1.0},
    {"step": 2, "prompt": "Name a vowel", "response": "e", "score": 0.5},
]


def step_metrics(step: int) -> dict[str, float]:
    return {
        "reward/mean": 0.25 * step,
        "actor/pg_loss": -0.5 + step,
        "timing/rollout_s": 1.5,
        "pass@1": 0.5,  # '@' is refused by MLflow, kept by the others
        "actor/grad_norm": float("nan"),  # non-finite values are not logged
    }


def feed(tracker: Tracker, first: int = 0) -> None:
    """What the training loop sends: metrics + progress per step, validation at step 2."""
    for step in range(first, STEPS):
        m = step_metrics(step + 1)
        tracker.log_metrics(m, step + 1)
        tracker.progress(step, STEPS, m, first)
        if step + 1 == 2:
            tracker.log_metrics({"val/reward_mean": 0.75}, 2)
            tracker.log_table(TABLE, "validation/step_000002.json")
    tracker.close()


def config(tmp_path, *loggers: str) -> RunConfig:
    return RunConfig(
        trainer=TrainerConfig(
            output_dir=str(tmp_path / "run"), loggers=list(loggers), wandb_mode="offline"
        )
    )


def test_tensorboard_event_files_hold_every_metric_and_the_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    feed(Tracker(config(tmp_path, "tensorboard"), rank=0))
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"reward/mean", "actor/pg_loss", "timing/rollout_s", "pass@1", "val/reward_mean"} <= set(
        scalars
    )
    assert "actor/grad_norm" not in scalars  # NaN at every step: nothing logged
    reward = [(e.step, e.value) for e in acc.Scalars("reward/mean")]
    assert reward == [(s, pytest.approx(0.25 * s)) for s in range(1, STEPS + 1)]
    assert [(e.step, e.value) for e in acc.Scalars("val/reward_mean")] == [(2, 0.75)]
    # text summaries are tensors: the generations table at step 2, the settings at step 0
    [table] = acc.Tensors("validation/generations/text_summary")
    assert table.step == 2
    text = table.tensor_proto.string_val[0].decode()
    assert "| step | prompt | response | score |" in text and "What is 2 \\| 3?" in text
    [settings] = acc.Tensors("config/text_summary")
    assert "trainer.wandb_mode" in settings.tensor_proto.string_val[0].decode()


def _history_once_written(run_file: Path, expected: list[int], timeout_s: float = 30.0) -> dict:
    """The run file's history; W&B's writer is a service process that, on a loaded machine, can
    still be appending the last records when ``finish()`` returns, so wait up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        steps = history(run_file)
        if sorted(steps) == expected or time.monotonic() > deadline:
            return steps
        time.sleep(0.2)


def test_wandb_offline_run_holds_every_metric_and_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    feed(Tracker(config(tmp_path, "wandb"), rank=0))
    [run_dir] = (tmp_path / "run" / "wandb").glob("offline-run-*")
    [run_file] = run_dir.glob("run-*.wandb")
    steps = _history_once_written(run_file, [1, 2, 3])
    assert sorted(steps) == [1, 2, 3]
    for step in (1, 2, 3):
        assert steps[step]["reward/mean"] == pytest.approx(0.25 * step)
        assert steps[step]["actor/pg_loss"] == pytest.approx(-0.5 + step)
        assert steps[step]["pass@1"] == 0.5
        assert "actor/grad_norm" not in steps[step]
    assert steps[2]["val/reward_mean"] == 0.75
    assert steps[2]["validation/generations/nrows"] == 2
    [table_file] = (run_dir / "files" / "media" / "table" / "validation").glob("*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["step", "prompt", "response", "score"]
    assert table["data"][1] == [2, "Name a vowel", "e", 0.5]


def test_wandb_run_continues_on_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config(tmp_path, "wandb")
    first = Tracker(cfg, rank=0)
    first.log_metrics(step_metrics(1), 1)
    first.close()
    saved = json.loads((tmp_path / "run" / RUN_IDS_FILE).read_text())
    resumed = Tracker(cfg, rank=0, start_step=1)
    assert resumed.loggers["wandb"].run_id == saved["wandb"] == first.loggers["wandb"].run_id
    resumed.close()
    fresh = Tracker(cfg, rank=0)  # not a resume: a new W&B run
    assert fresh.loggers["wandb"].run_id != saved["wandb"]
    fresh.close()


def test_console_shows_progress_and_validation_and_jsonl_has_everything(tmp_path, capsys):
    feed(Tracker(config(tmp_path, "console"), rank=0))
    err = capsys.readouterr().err.splitlines()
    progress = [line for line in err if line.startswith("[")]
    assert len(progress) == STEPS
    assert progress[-1].startswith("[####################] step 3/3  mean=0.75  pg_loss=2.5")
    assert "validation at step 2: val/reward_mean=0.75" in err
    assert any(line.startswith("validation at step 2: 2 generations, e.g. prompt=") for line in err)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2, 2, 3]
    assert records[0]["reward/mean"] == 0.25 and math.isnan(records[0]["actor/grad_norm"])
    # the run folder keeps the table too (megarl report shows it)
    kept = json.loads((tmp_path / "run" / "validation" / "step_000002.json").read_text())
    assert kept == TABLE


def test_sft_and_dpo_progress_lines_show_their_losses():
    sft = {"sft/loss": 1.25, "sft/tokens": 512.0, "timing/step_s": 0.5}
    dpo = {"dpo/loss": 0.6931, "dpo/reward_accuracy": 0.75, "timing/step_s": 0.5}
    assert "step 1/2  loss=1.25  step_s=0.5" in progress_line(Progress(1, 2, sft, 3.0))
    line = progress_line(Progress(1, 2, dpo, 3.0))
    assert "step 1/2  loss=0.6931  reward_accuracy=0.75  step_s=0.5" in line


def test_only_rank_zero_writes(tmp_path):
    tracker = Tracker(config(tmp_path, "console", "tensorboard"), rank=1)
    feed(tracker)
    assert tracker.loggers == {} and not (tmp_path / "run").exists()


def test_logger_list_is_checked_and_mlflow_uri_none_turns_mlflow_off(monkeypatch):
    assert active_loggers(["console", "mlflow", "console"], None) == ["console", "mlflow"]
    assert active_loggers(["console", "mlflow"], "none") == ["console"]
    assert active_loggers(["mlflow"], "None") == []
    with pytest.raises(ConfigError, match=r"unknown logger 'tensorbord'; choose from"):
        check_loggers(["console", "tensorbord"], None)
    missing = logger_base._Entry(lambda s: logger_base.Logger(), "megarl_no_such_package")
    monkeypatch.setitem(logger_base._REGISTRY, "wandb", missing)
    with pytest.raises(ConfigError, match=r"megarl_no_such_package package is not installed"):
        check_loggers(["console", "wandb"], None)
    check_loggers(["console"], None)  # not asked for: its package does not matter


REQUIRED = ["model.path=x", "data.train_files=[x.parquet]"]


def test_config_errors_name_the_fix():
    with pytest.raises(ConfigError, match="unknown logger 'tb'"):
        check_choices(load_config(None, [*REQUIRED, "trainer.loggers=[console,tb]"]))
    with pytest.raises(ConfigError, match=r"trainer.wandb_mode='local' is not one of"):
        load_config(None, [*REQUIRED, "trainer.wandb_mode=local"])
    cfg = load_config(None, [*REQUIRED, "trainer.loggers=[console,tensorboard,wandb]"])
    check_choices(cfg)
    assert cfg.trainer.loggers == ["console", "tensorboard", "wandb"]
    assert RunConfig().trainer.loggers == ["console", "mlflow"]


def mlflow_config(tmp_path: Path, store: str = "mlflow.db") -> RunConfig:
    return RunConfig(
        trainer=TrainerConfig(
            output_dir=str(tmp_path / "run"),
            loggers=["mlflow"],
            mlflow_tracking_uri=f"sqlite:///{tmp_path / store}",
        )
    )


def mlflow_client(tmp_path: Path, store: str = "mlflow.db"):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{tmp_path / store}")


# The rank's side of MLflow logging, run in a fresh interpreter: it must not import MLflow or
# SQLAlchemy (its writer process does), and it ends with every metric written.
RANK_SIDE = """
import sys
from megarl.config import RunConfig, TrainerConfig
from megarl.run.tracking import Tracker
cfg = RunConfig(trainer=TrainerConfig(output_dir=sys.argv[1] + "/run", loggers=["mlflow"],
                mlflow_tracking_uri="sqlite:///" + sys.argv[1] + "/mlflow.db"))
tracker = Tracker(cfg, rank=0)
tracker.begin()
tracker.log_metrics({"reward/mean": 0.5}, 1)
tracker.close()
print(tracker.mlflow_run_id, sorted(m for m in sys.modules if m.split(".")[0] in ("mlflow", "sqlalchemy")))
"""


def polled_waits(monkeypatch) -> list[float]:
    """The sleeps of ``subprocess.Popen.wait(timeout)``'s polling from now on (it sleeps between
    checks of its child, up to 50 ms each; megarl.child_wait waits for the exit itself)."""
    import subprocess

    sleeps: list[float] = []
    sleep = time.sleep

    def recorded(seconds: float) -> None:
        if sys._getframe(1).f_code.co_filename == subprocess.__file__:
            sleeps.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", recorded)
    return sleeps


def test_mlflow_run_holds_every_metric_the_settings_and_the_table(tmp_path, monkeypatch):
    import subprocess

    tracker = Tracker(mlflow_config(tmp_path), rank=0)
    polled = polled_waits(monkeypatch)
    feed(tracker)  # ends with the tracker's close: the writer ends its run and exits
    assert polled == []  # its exit was waited for, not polled
    run_id = tracker.mlflow_run_id
    assert json.loads((tmp_path / "run" / RUN_IDS_FILE).read_text()) == {"mlflow": run_id}
    client = mlflow_client(tmp_path)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(run_id, "reward/mean")}
    assert history == {s: pytest.approx(0.25 * s) for s in range(1, STEPS + 1)}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "pass_1")] == [
        (s, 0.5) for s in range(1, STEPS + 1)
    ]  # '@' renamed
    assert "actor/grad_norm" not in run.data.metrics  # NaN at every step: nothing logged
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val/reward_mean")] == [
        (2, 0.75)
    ]
    assert run.data.params["trainer.loggers"] == "['mlflow']"
    table = client.download_artifacts(run_id, "validation/step_000002.json", str(tmp_path))
    assert json.loads(Path(table).read_text())["data"][1] == [2, "Name a vowel", "e", 0.5]

    proc = subprocess.run(
        [sys.executable, "-c", RANK_SIDE, str(tmp_path / "fresh")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh_id, imported = proc.stdout.split(" ", 1)
    assert imported.strip() == "[]"
    [metric] = mlflow_client(tmp_path / "fresh").get_metric_history(fresh_id, "reward/mean")
    assert (metric.step, metric.value) == (1, 0.5)


# The writer run as ``python -m``, with two marks of how its process ends: the atexit handlers
# ran (MLflow's clean-ups), and the interpreter's teardown ran (a global's finalizer: it runs only
# when the interpreter deletes the main module's globals at exit).
WRITER_EXIT = """
import atexit, runpy, sys
out = sys.argv.pop(1)

class Teardown:
    def __init__(self):
        self.mark, self.create = out + "/teardown", open  # no builtins left by then

    def __del__(self):
        self.create(self.mark, "w").close()

kept_to_the_end = Teardown()
atexit.register(lambda: open(out + "/exit_handlers", "w").close())
runpy.run_module("megarl.loggers.mlflow_writer", run_name="__main__")
"""


def test_the_mlflow_writer_exits_without_the_interpreters_teardown_once_its_run_ended(tmp_path):
    """The teardown took about 1 s after a run's last line (a garbage collection over MLflow's
    and SQLAlchemy's objects): the writer skips it once the run has ended, and the run holds
    every metric, the table and the FINISHED status; MLflow's exit handlers still run."""
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER_EXIT, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    start = {"uri": uri, "experiment": "e", "run_name": "r", "resume_run_id": None}
    commands = [
        {"op": "start", **start, "params": {"trainer.total_steps": "2"}, "verbose": False},
        {"op": "metrics", "metrics": {"reward/mean": 0.5}, "step": 1},
        {"op": "metrics", "metrics": {"reward/mean": 0.75}, "step": 2},
        {"op": "table", "columns": {"step": [2], "score": [1.0]}, "name": "v/t.json", "step": 2},
        {"op": "end"},
    ]
    out, _ = proc.communicate("".join(json.dumps(c) + "\n" for c in commands), timeout=300)
    assert proc.returncode == 0
    started, ended = (json.loads(line) for line in out.splitlines())
    assert ended == {"ended": True}
    assert (tmp_path / "exit_handlers").exists()
    assert not (tmp_path / "teardown").exists()
    client = mlflow_client(tmp_path)
    run = client.get_run(started["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params == {"trainer.total_steps": "2"}
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    table = client.download_artifacts(run.info.run_id, "v/t.json", str(tmp_path))
    assert json.loads(Path(table).read_text())["data"] == [[2, 1.0]]


def test_mlflow_run_continues_on_resume_and_a_moved_run_gets_a_new_one_linked_to_it(
    tmp_path, capsys
):
    from megarl.loggers.mlflow_writer import RESUMED_FROM_TAG

    first = Tracker(mlflow_config(tmp_path), rank=0)
    for step in (1, 2, 3):  # the run checkpointed after step 1 and stopped after logging 3
        first.log_metrics({"reward/mean": float(step)}, step)
    first.close()
    resumed = Tracker(
        mlflow_config(tmp_path), rank=0, mlflow_run_id=first.mlflow_run_id, start_step=1
    )
    for step in (2, 3, 4):
        resumed.log_metrics({"reward/mean": 10.0 * step}, step)
    resumed.close()
    assert resumed.mlflow_run_id == first.mlflow_run_id
    history = mlflow_client(tmp_path).get_metric_history(first.mlflow_run_id, "reward/mean")
    # steps 2 and 3 are in MLflow once, as first logged; step 4 is new
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert "has no run" not in capsys.readouterr().err

    # the run folder resumed against another store (moved to another machine, a fresh mlflow.db)
    moved = Tracker(
        mlflow_config(tmp_path, "other.db"), rank=0, mlflow_run_id=first.mlflow_run_id, start_step=3
    )
    moved.log_metrics({"reward/mean": 50.0}, 5)
    moved.close()
    assert moved.mlflow_run_id != first.mlflow_run_id
    err = capsys.readouterr().err
    assert f"has no run {first.mlflow_run_id}" in err and "new MLflow run" in err
    [metric] = mlflow_client(tmp_path, "other.db").get_metric_history(
        moved.mlflow_run_id, "reward/mean"
    )
    assert (metric.step, metric.value) == (5, 50.0)
    # the new run names the old one (a tag), so the two can be found together
    tags = mlflow_client(tmp_path, "other.db").get_run(moved.mlflow_run_id).data.tags
    assert tags[RESUMED_FROM_TAG] == first.mlflow_run_id
    assert RESUMED_FROM_TAG not in mlflow_client(tmp_path).get_run(first.mlflow_run_id).data.tags
    assert (
        json.loads((tmp_path / "run" / RUN_IDS_FILE).read_text())["mlflow"] == moved.mlflow_run_id
    )


def test_a_store_mlflow_cannot_use_stops_the_run_before_its_first_step(tmp_path):
    from megarl.loggers.mlflow_logger import MlflowWriterError

    (tmp_path / "a_file").write_text("not a folder")
    cfg = RunConfig(
        trainer=TrainerConfig(
            output_dir=str(tmp_path / "run"),
            loggers=["mlflow"],
            mlflow_tracking_uri=f"sqlite:///{tmp_path / 'a_file' / 'mlflow.db'}",
        )
    )
    tracker = Tracker(cfg, rank=0)
    with pytest.raises(
        MlflowWriterError, match=r"could not start a run .*trainer\.mlflow_tracking_uri"
    ):
        tracker.begin()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_mlflow_writer_ends_the_run_failed_when_the_rank_dies(tmp_path):
    from megarl.loggers.mlflow_logger import MlflowLogger

    tracker = Tracker(mlflow_config(tmp_path), rank=0)
    tracker.log_metrics({"reward/mean": 1.0}, 1)
    logger = tracker.loggers["mlflow"]
    assert isinstance(logger, MlflowLogger)
    logger._pipe().close()  # what the writer sees when the rank is killed: the end of its input
    assert logger._proc.wait(timeout=120) == 0
    run = mlflow_client(tmp_path).get_run(tracker.mlflow_run_id)
    assert run.info.status == "FAILED"
    assert [
        m.value for m in mlflow_client(tmp_path).get_metric_history(run.info.run_id, "reward/mean")
    ] == [1.0]
