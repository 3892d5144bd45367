"""A rank's process is not dumpable from its first line: no other process of the same user can
read its environment (tokens, keys) or its memory through /proc or ptrace, and it leaves no core
dump. Checked on the entry point every trainer rank runs (``python -m megarl.entry``) and on the
torchrun agent megarl starts (``megarl.quiet_torchrun``), before either reads a config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import ctypes, sys
import {module} as m
try:
    code = m.main({argv})
except SystemExit as e:  # argparse's refusal of the arguments
    code = e.code
flag = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
print("dumpable", flag, "code", code)
"""


@pytest.mark.parametrize(
    ("module", "argv"),
    [("megarl.entry", "[]"), ("megarl.quiet_torchrun", "['--help-not-an-option']")],
)
def test_the_process_is_not_dumpable(module, argv):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module, argv=argv)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "dumpable 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
