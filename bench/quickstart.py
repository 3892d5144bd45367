"""The README's main job as a user runs it: ``make quickstart``, timed, with its reward curve.

    .venv/bin/python -m bench.quickstart [--repeats 1] [--smoke]

Each run prepares the quickstart's model and data offline (``python -m megarl.quickstart``) in a
fresh folder and runs ``megarl train configs/quickstart_cpu.yaml --nproc-per-node 1`` there, as
``make quickstart`` does: 40 GRPO steps of the tiny character-level Llama on the vowel reward.
Stored in ``bench/results/quickstart.json``: every run's wall time (preparation and training
apart), its per-step ``reward/mean`` and validation rewards, the means of its first and last four
steps, and the machine's load when it started. ``--smoke`` runs 2 steps (CI: the bench does not
rot). ``tests/e2e/test_quickstart.py`` runs the same job through :func:`run_quickstart` and
checks the curve the README quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.results_io import load_1min, write_results

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "quickstart_cpu.yaml"
EDGE_STEPS = 4  # the curve's start and end: the mean of this many first and last steps


@dataclass
class QuickstartRun:
    """One quickstart job: its timings and its curves."""

    steps: int
    prepare_s: float = 0.0
    train_s: float = 0.0
    load_1min: float = 0.0
    reward_mean: list[float] = field(default_factory=list)  # per step, step 1 first
    val_reward_mean: dict[int, float] = field(default_factory=dict)  # by step
    summary_line: str = ""  # the console's last line (stdout): the first and last step's reward
    console_tail: str = ""

    @property
    def first_mean(self) -> float:
        return sum(self.reward_mean[:EDGE_STEPS]) / len(self.reward_mean[:EDGE_STEPS])

    @property
    def last_mean(self) -> float:
        return sum(self.reward_mean[-EDGE_STEPS:]) / len(self.reward_mean[-EDGE_STEPS:])

    def figures(self) -> dict[str, object]:
        return asdict(self) | {
            f"first_{EDGE_STEPS}_mean": round(self.first_mean, 4),
            f"last_{EDGE_STEPS}_mean": round(self.last_mean, 4),
        }


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("MASTER_PORT", None)
    env.pop("MEGARL_FAULT", None)
    return env


def run_quickstart(work: Path, *overrides: str) -> QuickstartRun:
    """``make quickstart`` in ``work`` (its outputs/quickstart and mlflow.db land there), with
    ``overrides`` after the config (e.g. ``trainer.total_steps=2``); fails with the job's output
    if it fails."""
    work.mkdir(parents=True, exist_ok=True)
    run = QuickstartRun(steps=0, load_1min=load_1min())
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "megarl.quickstart", "--out", "outputs/quickstart"],
        cwd=work,
        env=_env(),
        check=True,
        capture_output=True,
    )
    run.prepare_s = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(CONFIG), "--nproc-per-node", "1"]
    proc = subprocess.run(
        [*cmd, *overrides], cwd=work, env=_env(), capture_output=True, text=True, timeout=1800
    )
    run.train_s = round(time.perf_counter() - t0, 2)
    run.console_tail = (proc.stdout + proc.stderr)[-1500:]
    run.summary_line = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode != 0:
        raise RuntimeError(f"the quickstart failed (exit {proc.returncode}):\n{run.console_tail}")
    rows = [json.loads(line) for line in (work / "outputs/quickstart/run/metrics.jsonl").open()]
    by_step: dict[int, dict[str, float]] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), {}).update(row)
    run.steps = max(by_step)
    run.reward_mean = [by_step[s]["reward/mean"] for s in range(1, run.steps + 1)]
    run.val_reward_mean = {
        s: r["val/reward_mean"] for s, r in sorted(by_step.items()) if "val/reward_mean" in r
    }
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="jobs run (every one stored)")
    parser.add_argument("--smoke", action="store_true", help="one job of 2 steps (CI)")
    args = parser.parse_args(argv)
    overrides = ["trainer.total_steps=2"] if args.smoke else []
    runs = []
    for i in range(1 if args.smoke else args.repeats):
        with tempfile.TemporaryDirectory(prefix="megarl-quickstart-") as tmp:
            run = run_quickstart(Path(tmp), *overrides)
        runs.append(run)
        print(
            f"run {i + 1}: {run.steps} steps, reward {run.first_mean:.2f} (first {EDGE_STEPS}) -> "
            f"{run.last_mean:.2f} (last {EDGE_STEPS}), step 1 {run.reward_mean[0]:.2f} -> "
            f"step {run.steps} {run.reward_mean[-1]:.2f}; prepare {run.prepare_s:.1f} s, "
            f"train {run.train_s:.1f} s (load {run.load_1min:.2f})",
            flush=True,
        )
    figures: dict[str, object] = {
        "command": "make quickstart (python -m megarl.quickstart; megarl train "
        "configs/quickstart_cpu.yaml --nproc-per-node 1) " + " ".join(overrides),
        "runs": [run.figures() for run in runs],
    }
    write_results("quickstart", figures, smoke=args.smoke)


if __name__ == "__main__":
    main()
