"""A user's environment holds megarl and what it runs, not the development tools: scripts/setup.sh
installs the `test` extra (pytest, ruff, mypy, TRL, ...) only with --test (what `make test` and
`make lint` run), and no runtime requirement pulls one of them in."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DEV_TOOLS = {"pytest", "pytest-xdist", "pytest-timeout", "hypothesis", "ruff", "mypy", "trl"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~;\s]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


def _setup_extras(*args: str) -> list[str]:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), "--print-extras", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return out.strip().split(",")


def test_setup_installs_the_development_tools_only_when_asked():
    runtime, with_tests = _setup_extras(), _setup_extras("--test")
    assert "test" not in runtime and "offline" in runtime  # the CPU jobs' data, not the tools
    assert with_tests == [*runtime, "test"]
    extras = _project()["optional-dependencies"]
    installed = _names(_project()["dependencies"])
    for extra in runtime:
        installed |= _names(extras[extra])
    assert not installed & DEV_TOOLS, installed & DEV_TOOLS
    assert _names(extras["test"]) >= DEV_TOOLS


def test_make_installs_the_tools_for_the_targets_that_use_them():
    text = (ROOT / "Makefile").read_text()
    assert "bash scripts/setup.sh --test" in text
    for target in ("lint", "test-unit", "test-distributed", "test-e2e", "bench"):
        assert re.search(rf"^{target}: \$\(TEST_STAMP\)$", text, re.M), target
    for target in ("quickstart", "demo", "learn"):
        assert re.search(rf"^{target}: \$\(STAMP\)$", text, re.M), target
