"""A full disk, a quota, a folder without write permission or a read-only filesystem met while a
rank writes (checkpoints, metrics) ends with one ``megarl: error:`` line naming the path and the
fix, exit status 2, not a traceback (megarl.storage_errors, megarl.entry)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.storage_errors import StorageError, storage_error

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# the rank's entry point, with the trainer replaced by one whose write fails as ``RAISE`` says
RANK = """
import errno, sys
import megarl.entry as entry

def trainer(cfg):
    try:
        {raise_}
    except OSError as e:  # as libraries do: re-raised as another type
        raise RuntimeError("saving failed") from e

entry.program = lambda cfg: trainer
sys.exit(entry.main([sys.argv[1], "trainer.output_dir=" + sys.argv[2]]))
"""


@pytest.mark.parametrize(
    ("raise_", "says"),
    [
        (
            "raise OSError(errno.ENOSPC, 'No space left on device', "
            "sys.argv[2] + '/checkpoints/.step_00000003.partial/actor/__0_0.distcp')",
            "/checkpoints/.step_00000003.partial/actor/__0_0.distcp: the disk is full",
        ),
        (  # torch's stream writer says it only in its text
            "raise RuntimeError('PytorchStreamWriter failed writing file data/0: "
            "[Errno 28] No space left on device')",
            "cannot write a file in trainer.output_dir=",
        ),
        (
            "raise PermissionError(errno.EACCES, 'Permission denied', sys.argv[2] + "
            "'/metrics.jsonl')",
            "/metrics.jsonl: permission denied",
        ),
    ],
)
def test_the_rank_ends_with_one_error_line_and_exit_2(tmp_path, raise_, says):
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  path: /m\ndata:\n  train_files: [/d.parquet]\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", RANK.format(raise_=raise_), str(config), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("megarl: error: cannot write ") and says in line, line
    assert "trainer.output_dir" in line and "resumes from the last complete checkpoint" in line


def test_each_cause_gets_its_fix_and_other_errors_are_not_taken_for_one():
    ro = storage_error(OSError(errno.EROFS, "Read-only file system", "/mnt/ro/run/x"), "/mnt/ro")
    assert isinstance(ro, StorageError) and ro.exit_code == 2
    assert "cannot write /mnt/ro/run/x: the filesystem is read-only" in str(ro)
    quota = storage_error(OSError(errno.EDQUOT, "Disk quota exceeded"), "/o")
    assert quota is not None and "quota" in str(quota) and "trainer.output_dir=/o" in str(quota)
    assert storage_error(FileNotFoundError(errno.ENOENT, "nope", "/x")) is None
    assert storage_error(RuntimeError("Permission denied by the hub")) is None  # text alone
    assert storage_error(ValueError("bad")) is None
