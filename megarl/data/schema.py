"""Column rules for the datasets, checked on each file's footer schema before any row is read.

The prompt schema is verl's RL parquet (`prompt`, `data_source`, `reward_model.ground_truth`,
`extra_info`), so files written for verl load unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pyarrow as pa

from megarl.data.errors import DataError
from megarl.data.parquet_source import ParquetFileInfo

MESSAGES_TYPE = "list<struct<role: string, content: string>>"


def _is_string(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_messages(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    item = t.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return all(k in names and _is_string(names[k]) for k in ("role", "content"))


@dataclass(frozen=True)
class ColumnRule:
    """What a column must look like: a type test, its description, and how to fix a mismatch."""

    accepts: Callable[[pa.DataType], bool]
    expected: str
    fix: str = ""


STRING = ColumnRule(_is_string, "string")
TEXT_OR_MESSAGES = ColumnRule(
    lambda t: _is_string(t) or _is_messages(t),
    f"a string or a list of chat messages ({MESSAGES_TYPE})",
    "write each value as a string, or as a list of {'role': ..., 'content': ...} dicts",
)
MESSAGES = ColumnRule(
    _is_messages,
    f"a list of chat messages ({MESSAGES_TYPE})",
    "write each conversation as a list of {'role': ..., 'content': ...} dicts",
)
REWARD_MODEL = ColumnRule(
    lambda t: pa.types.is_struct(t) and t.get_field_index("ground_truth") >= 0,
    "a struct with a 'ground_truth' field (verl's reward_model column)",
    "write reward_model as {'ground_truth': ..., 'style': 'rule'} per row",
)
ANY = ColumnRule(lambda t: True, "any type")


def check_columns(
    info: ParquetFileInfo,
    required: Mapping[str, ColumnRule],
    optional: Mapping[str, ColumnRule] | None = None,
    *,
    hint: str = "",
) -> None:
    """Raise a DataError naming the file and column when a column is missing or has the wrong type."""
    names = set(info.schema.names)
    for name, rule in required.items():
        if name not in names:
            raise DataError(
                f"{info.path}: missing column '{name}' ({rule.expected}); the file has columns "
                f"{sorted(names)}. {hint}".rstrip()
            )
    for name, rule in {**(optional or {}), **required}.items():
        if name in names:
            t = info.schema.field(name).type
            if not rule.accepts(t):
                fix = f" Fix: {rule.fix}." if rule.fix else ""
                raise DataError(
                    f"{info.path}: column '{name}' has type {t}; expected {rule.expected}.{fix}"
                )
