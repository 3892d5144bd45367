"""megarl.parked_rank: the one rank of a local one-process launch, started before the launcher's
checks. Real processes (a stand-in rank, tests/parked_echo.py): the go carries the arguments and
the late variables; a refused run kills the parked rank before its error goes on; a launcher that
goes away ends it quietly; the environment a launch computes for its rank equals the parked one
except for the variables the go carries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl import parked_rank
from megarl.parked_rank import LATE_ENV, ParkedRank
from megarl.rank_exit import ATTEMPT_ENV, FAILURE_FILE_ENV
from megarl.rank_process_env import local_rank_env

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ECHO = "tests.parked_echo"


@pytest.fixture(autouse=True)
def _from_the_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # `python -m tests.parked_echo` resolves from the working folder
    monkeypatch.delenv("MASTER_PORT", raising=False)


def _park(module: str = ECHO) -> ParkedRank:
    return ParkedRank.start(module, verbose=False, base=dict(os.environ))


def _environ(pid: int, within_s: float = 30.0) -> list[bytes]:
    """The process's environment. Popen returns once the child's exec has begun (its
    close-on-exec pipe closed), which the kernel does before it lays out the new program's
    environment: read early, on a loaded machine, /proc shows it empty. So read until it is not."""
    deadline = time.monotonic() + within_s
    while not (raw := Path(f"/proc/{pid}/environ").read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return raw.split(b"\0")


def test_a_parked_rank_has_the_launch_environment_and_waits():
    rank = _park()
    try:
        environ = _environ(rank.proc.pid)
        assert b"RANK=0" in environ and b"WORLD_SIZE=1" in environ
        assert any(v.startswith(b"MEGARL_GO_FD=") for v in environ)
        with pytest.raises(subprocess.TimeoutExpired):
            rank.proc.wait(timeout=2)  # parked: it waits for the go
    finally:
        rank.discard()


def test_a_released_rank_runs_with_what_the_go_sent(capfd):
    rank = _park()
    env = dict(rank.env, **{FAILURE_FILE_ENV: "/tmp/f.json"})
    env.pop(ATTEMPT_ENV, None)
    assert rank.release(["a.yaml", "x=1"], env).wait(timeout=60) == 0
    said = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert said == {
        "args": ["a.yaml", "x=1"],
        "late": {FAILURE_FILE_ENV: "/tmp/f.json", ATTEMPT_ENV: None},
        "go_fd_left": False,  # the pipe's variable is not passed on to the rank's children
    }


def test_a_discarded_rank_is_killed_and_prints_nothing(capfd):
    rank = _park()
    rank.discard()
    assert rank.proc.returncode == -9
    assert capfd.readouterr().out == ""


def test_a_launcher_that_goes_away_ends_its_parked_rank_quietly(capfd):
    rank = _park()
    os.close(rank.go_fd)  # what the launcher's exit does to the pipe
    assert rank.proc.wait(timeout=60) == 0
    assert capfd.readouterr().out == ""


def test_another_environment_or_program_is_a_mismatch():
    rank = _park()
    try:
        assert rank.mismatch("megarl.entry", rank.env) == ["module megarl.entry"]
        changed = dict(rank.env, OMP_NUM_THREADS="7", MALLOC_MMAP_MAX_="65536")
        assert rank.mismatch(ECHO, changed) == ["MALLOC_MMAP_MAX_", "OMP_NUM_THREADS"]
        extra = dict(rank.env, MEGARL_SOMETHING="1")
        assert rank.mismatch(ECHO, extra) == ["MEGARL_SOMETHING"]
    finally:
        rank.discard()


def test_a_launch_computes_the_parked_environment_but_for_the_late_variables():
    """What megarl.launch.run_torchrun computes for the one rank of a CPU launch (with the local
    launcher's failure file and an elastic attempt) is what the rank was parked with."""
    rank = _park()
    try:
        late = {FAILURE_FILE_ENV: "/tmp/x/failure.json", ATTEMPT_ENV: "{}"}
        launch = local_rank_env(os.environ, 1, False, rank.identity, None, False, late)
        assert rank.mismatch(ECHO, launch) == []
        assert set(LATE_ENV) <= set(launch)
        on_cuda = local_rank_env(os.environ, 1, True, rank.identity, None, False, late)
        # a GPU found late: CUDA ranks get no CPU allocator settings, so the parked one is not used
        assert "MALLOC_MMAP_MAX_" in rank.mismatch(ECHO, on_cuda)
    finally:
        rank.discard()


def test_a_refused_run_kills_its_parked_rank_before_the_error_goes_on():
    refused = pytest.raises(RuntimeError, match="refused")
    with refused, parked_rank.parked_rank(True, ECHO, verbose=False) as slot:
        rank = slot.rank
        assert rank is not None and rank.proc.poll() is None
        raise RuntimeError("refused")
    assert rank.proc.returncode == -9


def test_no_rank_is_parked_where_not_wanted_or_a_gpu_driver_is_present(monkeypatch):
    with parked_rank.parked_rank(False, ECHO, verbose=False) as slot:
        assert slot.rank is None
    monkeypatch.setattr(parked_rank, "GPU_DEVICE_NODES", (sys.executable,))  # "present"
    with parked_rank.parked_rank(True, ECHO, verbose=False) as slot:
        assert slot.rank is None
