"""megarl.child_wait: a child's exit code as soon as it ends, None while it runs past the limit;
on a kernel without pidfds, the same answers from Popen's own wait."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megarl.child_wait import wait_for_exit

pytestmark = pytest.mark.unit


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def _answers() -> tuple[int | None, int | None, int | None, float]:
    """(a child's exit code 3, a running child after 0.2 s, the same child once killed, seconds
    the running one was waited for)."""
    ended = _child("import sys; sys.exit(3)")
    running = _child("import time; time.sleep(60)")
    try:
        code = wait_for_exit(ended, 60.0)
        t0 = time.perf_counter()
        still = wait_for_exit(running, 0.2)
        waited = time.perf_counter() - t0
    finally:
        running.kill()
    return code, still, wait_for_exit(running, 60.0), waited


def test_the_exit_code_once_the_child_ends_and_none_while_it_runs_past_the_limit():
    code, still, killed, waited = _answers()
    assert (code, still, killed) == (3, None, -9)
    assert waited >= 0.2  # the limit is waited out (a loaded machine may take longer)


def test_a_child_already_reaped_answers_its_code_again():
    ended = _child("import sys; sys.exit(5)")
    assert ended.wait() == 5
    assert wait_for_exit(ended, 0.0) == 5


def test_without_pidfds_popens_wait_gives_the_same_answers(monkeypatch):
    def no_pidfds(pid: int, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    code, still, killed, waited = _answers()
    assert (code, still, killed) == (3, None, -9)
    assert waited >= 0.2
