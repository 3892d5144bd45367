"""docs/from_verl.md: every megarl key its table names is a field of the run config."""

import dataclasses
import re
from pathlib import Path

import pytest

from megarl.config import RunConfig

pytestmark = pytest.mark.unit

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "from_verl.md"


def _megarl_keys() -> list[str]:
    rows = [line for line in GUIDE.read_text().splitlines() if line.startswith("| `")]
    keys = []
    for row in rows:
        megarl_cell = row.split("|")[2]
        keys += re.findall(r"`([a-z_][a-z_.]*)`", megarl_cell)
    return keys


def _is_field(key: str) -> bool:
    node: object = RunConfig
    for part in key.split("."):
        names = {f.name: f for f in dataclasses.fields(node)}  # type: ignore[arg-type]
        if part not in names:
            return False
        factory = names[part].default_factory
        node = factory() if factory is not dataclasses.MISSING else names[part].default
    return True


def test_every_megarl_key_in_the_verl_table_is_a_config_field():
    keys = _megarl_keys()
    assert len(keys) >= 40, keys
    assert [k for k in keys if not _is_field(k)] == []
