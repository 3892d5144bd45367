"""The valid words of the ``Literal`` settings, read from the field types (for the messages
that name them and for configs built in code)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Literal, cast

from megarl.config.schema import RunConfig
from megarl.errors import ConfigError


def literal_words(hint: object) -> tuple[object, ...]:
    """The words of a ``Literal`` field type (``Literal[...] | None`` too); () for other types."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(w for arg in typing.get_args(hint) for w in literal_words(arg))
    return ()


def choice_fields(section: type, prefix: str = "") -> dict[str, tuple[object, ...]]:
    """Dotted key -> valid words of every ``Literal`` field under ``section``, nested ones too."""
    out: dict[str, tuple[object, ...]] = {}
    hints = typing.get_type_hints(section)
    for f in dataclasses.fields(section):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out.update(choice_fields(cast(type, hint), f"{prefix}{f.name}."))
        elif words := literal_words(hint):
            out[f"{prefix}{f.name}"] = words
    return out


def choices(key: str) -> tuple[object, ...]:
    """The valid words of the setting ``key`` (e.g. ``"model.dtype"``), read from its field type."""
    return choice_fields(RunConfig)[key]


def check_field_words(cfg: RunConfig) -> None:
    for key, allowed in choice_fields(RunConfig).items():
        value: object = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value is not None and value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
