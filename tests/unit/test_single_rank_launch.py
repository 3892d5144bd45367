"""A one-process job runs its rank directly, without torchrun (megarl.launch.run_torchrun): the
rank gets the environment torchrun would give it, and a failure is reported as torchrun's wrapper
reports it (exit status, the one-line note, the failure record the elastic supervisor reads)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RANK = textwrap.dedent(
    """
    import os, signal, sys, time
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    print({k: os.environ.get(k) for k in keys}, flush=True)
    print("shm prefix", os.environ.get("MEGARL_SHM_PREFIX"), flush=True)
    how = sys.argv[1]
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "slow":  # the launcher waits for it
        time.sleep(0.5)
        sys.exit(0)
    sys.exit(int(how))
    """
)

LAUNCHER = textwrap.dedent(
    """
    import sys
    from megarl.launch import run_torchrun
    from megarl.rank_exit import FAILURE_FILE_ENV
    code = run_torchrun(
        "fake_rank", [sys.argv[1]], 1, env_extra={FAILURE_FILE_ENV: sys.argv[2]}
    )
    print("launcher exit", code, flush=True)
    """
)


# The launcher as above, where a sleep of subprocess's (Popen.wait(timeout) sleeps between its
# checks of the child, up to 50 ms each) ends it: it must wait for its rank's exit itself.
UNPOLLED = LAUNCHER.replace(
    "code = run_torchrun(",
    textwrap.dedent(
        """
        import subprocess, time
        def sleep(seconds, sleep=time.sleep):
            if sys._getframe(1).f_code.co_filename == subprocess.__file__:
                raise SystemExit(f"the launcher polled its rank (a sleep of {seconds} s)")
            sleep(seconds)
        time.sleep = sleep
        code = run_torchrun("""
    ),
)


def _launch(
    tmp_path: Path, how: str, launcher: str = LAUNCHER
) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "fake_rank.py").write_text(RANK)
    failure = tmp_path / f"failure-{how}.json"
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", launcher, how, str(failure)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    return proc, failure


def test_the_one_rank_gets_torchruns_environment_and_a_clean_exit_records_nothing(tmp_path):
    proc, failure = _launch(tmp_path, "0")
    assert "launcher exit 0" in proc.stdout, proc.stderr
    env = ast.literal_eval(proc.stdout.splitlines()[0])  # the rank's printed dict
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["LOCAL_RANK"] == "0"
    assert env["LOCAL_WORLD_SIZE"] == "1" and env["MASTER_ADDR"] == "127.0.0.1"
    assert int(env["MASTER_PORT"]) > 0
    assert "shm prefix megarl-" in proc.stdout  # the job's vLLM segment prefix
    assert not failure.exists()


def test_a_failed_rank_is_reported_as_torchrun_reports_it(tmp_path):
    proc, failure = _launch(tmp_path, "3")
    assert "launcher exit 3" in proc.stdout
    assert json.loads(failure.read_text()) == {"rank": 0, "exit_code": 3}
    assert "megarl: rank 0 exited with code 3" in proc.stderr

    proc, failure = _launch(tmp_path, "kill")
    assert "launcher exit 137" in proc.stdout  # 128 + SIGKILL, as a shell says
    assert json.loads(failure.read_text()) == {"rank": 0, "exit_code": -9}
    assert "megarl: rank 0 was killed by SIGKILL" in proc.stderr


def test_a_user_error_stays_the_last_line(tmp_path):
    proc, failure = _launch(tmp_path, "2")  # megarl's user-error exit code
    assert "launcher exit 2" in proc.stdout
    assert json.loads(failure.read_text()) == {"rank": 0, "exit_code": 2}
    assert "megarl: rank" not in proc.stderr


def test_the_launcher_learns_of_its_ranks_end_when_it_happens_not_at_its_next_poll(tmp_path):
    """Popen.wait(timeout) polled: the command ended up to 50 ms after its rank
    (megarl.child_wait)."""
    proc, failure = _launch(tmp_path, "slow", UNPOLLED)
    assert "launcher exit 0" in proc.stdout, proc.stderr[-2000:]
    assert not failure.exists()
