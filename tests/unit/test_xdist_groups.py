"""`make test` runs the multi-process tiers on two xdist workers with ``--dist loadgroup``: the
tests that check one shared run carry an ``xdist_group`` mark and must land on one worker, or the
run happens once per worker (and Ray tests could start two clusters at once). This pins that the
installed pytest and pytest-xdist honour the marks, both as a module's ``pytestmark`` and on a
test."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

MODULE_GROUP = """
import pytest
pytestmark = pytest.mark.xdist_group("shared")
def test_1(): pass
def test_2(): pass
def test_3(): pass
"""
TEST_GROUP = """
import pytest
TOGETHER = pytest.mark.xdist_group("pair")
@TOGETHER
def test_1(): pass
@TOGETHER
def test_2(): pass
def test_free_1(): pass
def test_free_2(): pass
"""


def test_grouped_tests_run_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_module_group.py").write_text(MODULE_GROUP)
    (tmp_path / "test_test_group.py").write_text(TEST_GROUP)
    args = ["-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\].*PASSED (\S+)", proc.stdout)
    assert len(ran) == 7, proc.stdout
    workers: dict[str, set[str]] = {}
    for worker, test in ran:
        if "@" in test:
            workers.setdefault(test.rsplit("@", 1)[1], set()).add(worker)
    # 3 tests of the module's group and 2 of the marked pair, each group on one worker
    assert sorted(t.rsplit("@", 1)[1] for _, t in ran if "@" in t) == ["pair"] * 2 + ["shared"] * 3
    assert all(len(w) == 1 for w in workers.values()), ran
