"""A live run, as a second `megarl train` and a `kill -9` meet it: the second run into its folder
is refused before launch, naming it; its ranks end with its launcher, however it is killed. Its
folder holds its resolved config.yaml.

One launch of the one-process quickstart-size run (stopped by SIGKILL once its first step is
logged); the refused second run leaves no process (the rank it started beside its checks is
killed with the refusal).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.config import load_config
from tests.e2e.test_train import make_workdir

pytestmark = pytest.mark.e2e


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of a live process; None once it has gone (or is a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[3]))


def _environ(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b"\n").decode(errors="replace")
        )
    except OSError:
        return ""


def _processes() -> dict[int, tuple[int, int]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                out[int(entry.name)] = stat
    return out


def job_processes(launcher: int, ranks: set[int]) -> set[int]:
    """The launcher's descendants and every process of the ranks' sessions (their helpers)."""
    procs = _processes()
    found = {p for p, (_, sid) in procs.items() if sid in ranks}
    frontier = {launcher}
    while frontier:
        children = {p for p, (ppid, _) in procs.items() if ppid in frontier}
        frontier = children - found
        found |= children
    return found


def test_a_live_run_holds_its_folder_and_its_ranks_end_with_its_killed_launcher(tmp_path):
    work = make_workdir(tmp_path)
    out = work / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    env.pop("MEGARL_FAULT", None)
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(work / "run.yaml")]
    settings = [f"trainer.output_dir={out}", "trainer.total_steps=1000", "trainer.test_freq=0"]
    log = (work / "first.log").open("w")
    first = subprocess.Popen(
        [*cmd, *settings, "--nproc-per-node", "1"], stdout=log, stderr=log, env=env, cwd=work
    )
    job: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):  # its first step is logged
            assert first.poll() is None, (work / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run logged no step in 300 s"
            time.sleep(0.5)
        # the run folder keeps the resolved config, written by rank 0 at start
        assert load_config(out / "config.yaml").trainer.total_steps == 1000
        ranks = {p for p, (ppid, _) in _processes().items() if ppid == first.pid}
        assert ranks, "the one-process run has no rank process"
        job = job_processes(first.pid, ranks)

        mark = f"MEGARL_TEST_SECOND_RUN={os.getpid()}-{time.monotonic_ns()}"
        second = subprocess.run(
            [*cmd, *settings[:1]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, mark.split("=")[0]: mark.split("=")[1]},
            cwd=work,
            timeout=600,
        )
        assert second.returncode == 2, second.stdout[-3000:]
        # the rank it started beside its checks (megarl.parked_rank) was killed with the refusal:
        # no process of this run is left (told apart from other tests' ranks by its environment)
        assert not [p for p in _processes() if mark in _environ(p)]
        [line] = [ln for ln in second.stdout.splitlines() if ln.startswith("megarl: error:")]
        assert "in use by a live run" in line
        assert f"host {socket.gethostname()}, pid {first.pid}, started " in line
        assert "starting" not in second.stdout  # refused before launch
        assert first.poll() is None

        first.send_signal(signal.SIGKILL)  # kill -9 of `megarl train`: no handler runs
        first.wait(timeout=10)
        deadline = time.monotonic() + 15
        while (left := {p for p in job if _stat(p) is not None}) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not left, f"processes of the killed run left after 15 s: {sorted(left)}"
    finally:
        if first.poll() is None:
            first.kill()
        for pid in job:  # what a failed check left running
            if _stat(pid) is not None:
                os.kill(pid, signal.SIGKILL)
        log.close()
