"""The README's main job, run as a user runs it: `megarl demo` launches torchrun on 4 ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from megarl.ports import free_port


def test_demo_runs_tp2_pp2_and_reports_parity():
    env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl.cli",
            "demo",
            "--model",
            "tiny-llama",
            "--nproc",
            "4",
            "--tp",
            "2",
            "--pp",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layout TP2xPP2xDP1" in proc.stdout
    match = re.search(r"PARITY OK: worst ([0-9.e+-]+)", proc.stdout)
    assert match, proc.stdout
    assert float(match.group(1)) < 1e-5
    # A quiet console: megarl's own progress lines only, no library warnings or progress bars.
    noise = [line for line in proc.stderr.splitlines() if not line.startswith("megarl: ")]
    assert not noise, proc.stderr[-3000:]
