"""Settings checks of the reliability features, the fault-injection spec, the hang watchdog and
the preemption signal handlers (in small subprocesses, without torch.distributed)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.run import faults
from megarl.run.watchdog import HANG_EXIT_CODE, collective_timeout_s

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
BASE = ["model.path=/m", "data.train_files=[/d.parquet]"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.keep_last=0", "trainer.keep_last=0: at least the newest"),
        ("trainer.keep_every=-1", "trainer.keep_every=-1 must be >= 0"),
        ("trainer.hang_timeout_s=0", "trainer.hang_timeout_s=0.0 must be > 0"),
        ("trainer.hang_timeout_s=-5", "trainer.hang_timeout_s=-5.0 must be > 0"),
    ],
)
def test_bad_reliability_settings_are_refused(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(None, [*BASE, override])


def test_defaults_are_valid():
    t = load_config(None, BASE).trainer
    assert t.keep_last >= 1 and t.keep_every == 0 and t.hang_timeout_s > 0


def test_fault_spec_parses_and_rejects_typos():
    assert faults.parse("kill@save:rank=1:step=2, sleep@sync") == [
        ("kill", "save", {"rank": 1, "step": 2}),
        ("sleep", "sync", {}),
    ]
    with pytest.raises(ValueError, match="bad entry"):
        faults.parse("explode@save")


def test_collective_timeout_exceeds_the_watchdogs():
    assert collective_timeout_s(10) > 10 and collective_timeout_s(3600) > 3600


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )


def test_watchdog_prints_stacks_and_exits_when_a_phase_hangs():
    t0 = time.monotonic()
    proc = run_python(
        """
        import time
        from megarl.run import watchdog
        watchdog.start(1.0, rank=7)
        watchdog.beat("step", 4)
        with watchdog.phase("update_actor"):
            time.sleep(0.5)  # progress within the timeout
        with watchdog.phase("rollout"):
            time.sleep(60)  # a hang
        """
    )
    assert time.monotonic() - t0 < 30
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr
    err = proc.stderr
    assert "rank 7: no progress for" in err and "phase 'rollout' of step 5" in err
    assert "most recent call first" in err and "time.sleep(60)" not in err  # faulthandler frames
    assert '<string>", line 9' in err  # the stuck line of the main thread
    assert "megarl: error: rank 7 hung" in err and "trainer.hang_timeout_s" in err


def test_first_signal_asks_to_stop_and_second_stops_at_once():
    proc = run_python(
        """
        import os, signal, sys
        from megarl.run.preemption import Preemption
        p = Preemption(rank=0)
        os.kill(os.getpid(), signal.SIGTERM)
        print("after first:", p.received.name, flush=True)
        os.kill(os.getpid(), signal.SIGUSR1)
        print("not reached", flush=True)
        """
    )
    assert "after first: SIGTERM" in proc.stdout and "not reached" not in proc.stdout
    assert proc.returncode == -15 or proc.returncode == -10, proc.returncode
    assert "second SIGUSR1: stopping now" in proc.stderr


def test_the_launcher_turns_a_ctrl_c_into_a_graceful_stop_and_a_second_into_an_immediate_one():
    """What `megarl train` does with Ctrl-C, against a stand-in for torchrun and one rank: the
    first SIGINT asks the rank to finish its step (SIGUSR2: an interruption), the second kills
    the job at once; the command's exit status is 130 either way."""
    proc = run_python(
        """
        import os, signal, subprocess, sys, tempfile, time
        from pathlib import Path
        from megarl.launch import _forwarding_signals
        ready = Path(tempfile.mkdtemp()) / "rank-ready"
        rank = (
            "import signal, time\\n"
            "def got(*a):\\n"
            "    print('rank: SIGUSR2', flush=True)\\n"
            f"    open({str(ready)!r} + '-usr2', 'w').close()\\n"
            "signal.signal(signal.SIGUSR2, got)\\n"
            f"open({str(ready)!r}, 'w').close()\\n"
            "print('rank up', flush=True)\\n"
            "time.sleep(60)\\n"
        )
        torchrun = (
            "import subprocess, sys\\n"
            f"p = subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True)\\n"
            "print('rank pid', p.pid, flush=True)\\n"
            "p.wait()\\n"
        )
        job = subprocess.Popen([sys.executable, "-c", torchrun], start_new_session=True)
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:  # its handler is installed
            time.sleep(0.1)
        with _forwarding_signals(job) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            got = Path(str(ready) + "-usr2")
            while not got.exists() and time.monotonic() < deadline:  # the rank was asked
                time.sleep(0.1)
            print("graceful exit status would be", stop.exit_code(0), flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            code = job.wait(timeout=20)
        print("exit status", stop.exit_code(code), flush=True)
        """
    )
    out, err = proc.stdout, proc.stderr
    assert "rank: SIGUSR2" in out, (out, err)
    assert "graceful exit status would be 130" in out and "exit status 130" in out
    assert "SIGINT received: asking the 1 ranks" in err and "press Ctrl-C again" in err
    assert "second SIGINT: stopping at once" in err
    pid = int(re.search(r"rank pid (\d+)", out).group(1))
    stat = Path(f"/proc/{pid}/stat")  # the rank was killed with the job (gone, or a zombie)
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
