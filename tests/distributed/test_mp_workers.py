"""tests.mp's workers, forked from a fork server started earlier, see the caller's environment
and working directory as of each call, and the server's imports are already done."""

from __future__ import annotations

import os
import sys

from tests.mp import run_gloo


def _report(rank: int, world: int) -> tuple[str | None, str, bool]:
    return os.environ.get("MEGARL_MP_PROBE"), os.getcwd(), "megatron.core" in sys.modules


def test_forked_workers_take_the_callers_environment_and_folder(tmp_path, monkeypatch):
    first = run_gloo(_report, 2)  # starts the fork server, if no test has yet
    monkeypatch.setenv("MEGARL_MP_PROBE", "after the server started")
    monkeypatch.chdir(tmp_path)
    second = run_gloo(_report, 2)
    assert all(r[0] is None for r in first), first
    assert second == [("after the server started", str(tmp_path), True)] * 2
