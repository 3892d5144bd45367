"""megarl.parent_death: a process ends with its parent, however the parent ends, and one whose
launcher died while it started ends at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.parent_death import PARENT_ENV

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's"),
]

CHILD = (
    "import os, sys, time\n"
    "from megarl.parent_death import end_with_parent, parent_death_signal, PARENT_ENV\n"
    "end_with_parent()\n"
    "end_with_parent()\n"  # a second call (init_distributed after entry.main) changes nothing
    "print(parent_death_signal(), PARENT_ENV in os.environ, flush=True)\n"
    "time.sleep(float(sys.argv[1]))\n"
)


def test_a_child_of_its_launcher_gets_the_signal_and_passes_no_parent_on():
    env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "0"], env=env, capture_output=True, text=True, check=True
    )
    # the variable is gone: a process further down, started by another program, checks nothing
    assert out.stdout.split() == [str(int(signal.SIGKILL)), "False"]


def test_a_child_whose_launcher_is_gone_ends_at_once():
    env = dict(os.environ, **{PARENT_ENV: "1"})  # another parent than the one it has
    proc = subprocess.run([sys.executable, "-c", CHILD, "60"], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout == b""


def test_a_grandchild_ends_when_its_parent_is_killed(tmp_path: Path):
    # the parent (a launcher) starts the child (a rank) and is killed by SIGKILL
    pidfile = tmp_path / "child.pid"
    launcher = (
        "import os, subprocess, sys, time\n"
        "from megarl.parent_death import children_env\n"
        f"child = subprocess.Popen([sys.executable, '-c', {CHILD!r}, '60'],\n"
        "    env=dict(os.environ, **children_env()), stdout=subprocess.PIPE, text=True)\n"
        "child.stdout.readline()\n"  # the child has set its signal
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher])
    deadline = time.monotonic() + 30
    while not pidfile.is_file() or not pidfile.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    child = int(pidfile.read_text())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the child outlived its killed parent"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
