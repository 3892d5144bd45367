"""A single-node job listens on loopback only: the rendezvous store torchrun starts, the sockets a
rank opens for its collectives, and every service of the local Ray instance are bound to
127.0.0.1 (or ::1), never to every interface; and a rank is not dumpable, so no other process of
its user reads its memory or environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.launch import run_torchrun
from tests.distributed.listener_workers import is_loopback

ROOT = Path(__file__).resolve().parents[2]


def test_a_single_node_job_listens_on_loopback_and_its_ranks_are_not_dumpable(tmp_path):
    report = tmp_path / "report"
    code = run_torchrun(
        "tests.distributed.listener_workers", ["rank", str(report)], 2, threads_per_rank=1
    )
    assert code == 0
    for r in range(2):
        found = json.loads(Path(f"{report}.{r}").read_text())
        assert {s["what"] for s in found["listening"]} == {"store", "rank"}, found
        assert [s for s in found["listening"] if not is_loopback(s["address"])] == [], found
        assert found["dumpable"] == 0, found


@pytest.mark.xdist_group("ray")
def test_the_local_ray_instance_listens_on_loopback(tmp_path):
    report = tmp_path / "ray.json"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distributed.listener_workers", "ray", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(report.read_text())["listening"]
    assert len({s["what"] for s in found}) >= 2, found  # at least the GCS and the raylet
    assert [s for s in found if not is_loopback(s["address"])] == [], found
