"""Where a launch's time goes: ``megarl train configs/quickstart_cpu.yaml --nproc-per-node 1`` for
one step, phase by phase, best of N (printed, not asserted).

    .venv/bin/python -m bench.startup [--repeats 2] [--before PATH] [--smoke]

Each run is timed from outside by the arrival of the console's lines (the wall clock of a user
at a terminal): the launcher (command start -> "starting 1 rank(s)"), the rank's start
(interpreter, imports, process group -> "started 1 rank(s)"), setup (data, models -> "starting the
rollout engine"), the engine's start (-> "first step"), the step (-> its progress line, once its
metrics are logged: a tracker that starts late shows here), the checkpoint and summary (-> the
last line) and the teardown (last line -> the command's exit). One more run per tree
records the rank's imports (``PYTHONPROFILEIMPORTTIME``), summed by top-level package from each
module's own time.

``--before PATH`` times another checkout of megarl (e.g. a ``git worktree`` of an older commit)
with the same interpreter, alternating with this one, so both are measured on the same machine
in the same minutes. The results file keeps the issue's figures for the launch before this work
beside them. The quickstart's model and data are prepared (offline, seconds) when missing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.results_io import load_1min, write_results

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/quickstart_cpu.yaml"
MARKS = {
    "launch": "starting 1 rank(s)",
    "started": "started 1 rank(s)",
    "engine": "starting the rollout engine",
    "first_step": "first step:",
    # the step's progress line: its metrics are logged, so the trackers are up by then
    "step_logged": "step 1/1",
}
# The launch of issue 41 before this work (a fresh clone, a quiet 2-core machine, one step).
ISSUE_BEFORE = {
    "source": "issue 41, measured on a fresh clone before this work",
    "first_step_s": 18.5,
    "end_s": 35.8,
    "rank_imports_s": 17.0,
    "engine_start_s": 6.0,
    "teardown_s": 7.0,
}
IMPORT_LINE = re.compile(r"import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)")


@dataclass
class Launch:
    """One timed run: seconds from the command's start to each mark."""

    tree: str
    marks: dict[str, float] = field(default_factory=dict)
    last_line_s: float = 0.0
    end_s: float = 0.0
    exit_code: int = 0
    load_1min: float = 0.0

    def phases(self) -> dict[str, float]:
        m = self.marks
        return {
            "launcher_s": m["launch"],
            "rank_start_s": m["started"] - m["launch"],
            "setup_s": m["engine"] - m["started"],
            "engine_start_s": m["first_step"] - m["engine"],
            "step_s": m["step_logged"] - m["first_step"],
            "save_s": self.last_line_s - m["step_logged"],
            "teardown_s": self.end_s - self.last_line_s,
            "first_step_s": m["first_step"],
            "step_logged_s": m["step_logged"],
            "end_s": self.end_s,
        }


def _command(out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        CONFIG,
        "--nproc-per-node",
        "1",
        "trainer.total_steps=1",
        f"trainer.output_dir={out}",
        f"trainer.mlflow_tracking_uri=sqlite:///{out.parent / 'mlflow.db'}",
    ]


def _env(tree: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), **(extra or {}))
    env.pop("MASTER_PORT", None)
    return env


def timed_launch(tree: Path, work: Path) -> Launch:
    """Run the one-step launch in ``tree`` and time its console lines as they arrive."""
    out = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    launch = Launch(str(tree), load_1min=load_1min())
    start = time.perf_counter()
    proc = subprocess.Popen(
        _command(out),
        cwd=tree,
        env=_env(tree),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        now = time.perf_counter() - start
        lines.append(line)
        launch.last_line_s = now
        for name, text in MARKS.items():
            if name not in launch.marks and text in line:
                launch.marks[name] = now
    launch.exit_code = proc.wait()
    launch.end_s = time.perf_counter() - start
    missing = [name for name in MARKS if name not in launch.marks]
    if launch.exit_code != 0 or missing:
        raise SystemExit(
            f"bench.startup: the launch in {tree} failed (exit {launch.exit_code}, no "
            f"{missing} line):\n{''.join(lines[-30:])}"
        )
    return launch


def rank_imports(tree: Path, work: Path) -> dict[str, float]:
    """Seconds of the rank's imports by top-level package (each module's own time), from one
    run with Python's import-time report; the launcher's own imports are left out."""
    out = Path(tempfile.mkdtemp(prefix="imports-", dir=work))
    proc = subprocess.run(
        _command(out),
        cwd=tree,
        env=_env(tree, {"PYTHONPROFILEIMPORTTIME": "1"}),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"bench.startup: the import-profiled launch failed:\n{proc.stderr[-3000:]}"
        )
    by_package: dict[str, float] = defaultdict(float)
    in_rank = False
    for line in proc.stderr.splitlines():
        if MARKS["launch"] in line:  # what follows is the rank's
            in_rank = True
        match = IMPORT_LINE.search(line)
        if in_rank and match:
            by_package[match.group(4).split(".")[0]] += int(match.group(1)) / 1e6
    top = sorted(by_package.items(), key=lambda kv: -kv[1])
    return {name: round(seconds, 3) for name, seconds in top if seconds >= 0.05}


def best(launches: list[Launch]) -> dict[str, float]:
    """Each phase's figures from the run that ended first (phases of one run add up)."""
    chosen = min(launches, key=lambda launch: launch.end_s)
    return {k: round(v, 2) for k, v in chosen.phases().items()}


def prepare(tree: Path) -> None:
    if not (tree / "outputs" / "quickstart" / "model" / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "megarl.quickstart", "--out", "outputs/quickstart"],
            cwd=tree,
            env=_env(tree),
            check=True,
            capture_output=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per tree (best kept)")
    parser.add_argument("--before", type=Path, default=None, help="another megarl checkout")
    parser.add_argument("--smoke", action="store_true", help="one run, no import profile (CI)")
    args = parser.parse_args(argv)
    trees = {"megarl": ROOT}
    if args.before is not None:
        if not (args.before / "megarl" / "cli.py").is_file():
            raise SystemExit(f"bench.startup: --before {args.before} is not a megarl checkout")
        trees["before"] = args.before.resolve()
    repeats = 1 if args.smoke else args.repeats
    for tree in trees.values():
        prepare(tree)
    runs: dict[str, list[Launch]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="megarl-startup-") as tmp:
        for i in range(repeats):  # alternated: both trees see the same minutes
            for name, tree in trees.items():
                launch = timed_launch(tree, Path(tmp))
                runs[name].append(launch)
                print(
                    f"{name} run {i + 1}: first step {launch.phases()['first_step_s']:.1f} s, "
                    f"end {launch.end_s:.1f} s (load {launch.load_1min:.2f})",
                    flush=True,
                )
        imports = {} if args.smoke else {n: rank_imports(t, Path(tmp)) for n, t in trees.items()}
    figures: dict[str, object] = {
        "command": "megarl train configs/quickstart_cpu.yaml --nproc-per-node 1 "
        "trainer.total_steps=1",
        "repeats": repeats,
        "best": {name: best(launches) for name, launches in runs.items()},
        "runs": {
            name: [asdict(r) | r.phases() for r in launches] for name, launches in runs.items()
        },
        "rank_imports_s": imports,
        "issue_before": ISSUE_BEFORE,
    }
    best_phases = {name: best(launches) for name, launches in runs.items()}
    for name, phases in best_phases.items():
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in phases.items()))
    for name, packages in imports.items():
        print(f"{name} rank imports: " + ", ".join(f"{k} {v:.2f}" for k, v in packages.items()))
    write_results("startup", figures, smoke=args.smoke)


if __name__ == "__main__":
    main()
