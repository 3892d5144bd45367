"""megarl without the mlflow package: with MLflow not among the loggers it imports, loads configs
and tracks runs; with MLflow asked for, the error names the fix. MLflow is made unimportable in
a fresh interpreter by a meta-path finder, as if it were not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class NoMlflow(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "mlflow" or name.startswith("mlflow."):
                raise ImportError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoMlflow())
    try:
        import mlflow  # noqa: F401
        raise SystemExit("the blocker did not block")
    except ImportError:
        pass

    import megarl.cli, megarl.entry, megarl.trainer.loop, megarl.reward_model.train  # noqa
    from megarl.config import load_config
    from megarl.errors import ConfigError
    from megarl.run.checks import check_choices
    from megarl.run.tracking import Tracker

    out, required = sys.argv[1], ["model.path=x", "data.train_files=[x.parquet]"]
    for extra in (["trainer.loggers=[console,tensorboard]"], ["trainer.mlflow_tracking_uri=none"]):
        cfg = load_config(None, [*required, f"trainer.output_dir={out}", *extra])
        tracker = Tracker(cfg, rank=0)
        tracker.log_metrics({"reward/mean": 0.5}, 1)
        tracker.close()
        print("tracked with", sorted(tracker.loggers))
    try:
        check_choices(load_config(None, required))  # the default loggers include MLflow
    except ConfigError as e:
        print("error:", e)
    assert "mlflow" not in sys.modules
    """
)


def test_megarl_imports_and_tracks_without_mlflow(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tracked with ['console', 'tensorboard']" in proc.stdout
    assert "tracked with ['console']" in proc.stdout
    assert (
        "error: trainer.loggers includes 'mlflow' but the mlflow package is not installed"
        in proc.stdout
    )
    assert "trainer.mlflow_tracking_uri=none" in proc.stdout
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
