"""The fork server of tests.mp imports its libraries without starting a thread: a forked worker
keeps only the forking thread, so a thread started by an import (a BLAS pool, a background
allocator thread) would be missing in every worker, its locks possibly held."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = "import os, tests.mp_preload; print('threads:', len(os.listdir('/proc/self/task')))"


def test_the_fork_servers_imports_start_no_thread():
    env = dict(os.environ, OMP_NUM_THREADS="1")  # as tests/conftest.py sets it for the server
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "threads: 1" in proc.stdout, proc.stdout
