"""Test tiers are named by folder: tests/unit, tests/distributed, tests/e2e get the marker of the same name."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# Keep each test process to the threads it is given: 2 cores are shared by multi-process tests.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Property tests draw the same examples on every run (no example database, derandomised): a CI
# run cannot turn red by chance.
settings.register_profile("megarl", derandomize=True, database=None, print_blob=True)
settings.load_profile("megarl")

_TIERS = ("unit", "distributed", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.parts
        for tier in _TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
