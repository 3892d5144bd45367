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


# What a value of each scalar type looks like, for the message of a value of the wrong type.
_KINDS = {int: "a whole number", float: "a number", bool: "true or false", str: "text"}


def expected_value(key: str, section: type = RunConfig) -> str:
    """What the setting ``key`` takes, in words ("a whole number", "a list of text, or null"),
    read from its field type; "" when ``key`` is not a setting."""
    owner: type = section
    parts = key.split(".")
    for part in parts[:-1]:
        hint = typing.get_type_hints(owner).get(part)
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            return ""
        owner = hint
    hint = typing.get_type_hints(owner).get(parts[-1])
    return "" if hint is None else _describe(hint)


def _describe(hint: object) -> str:
    if words := literal_words(hint):
        return "one of " + ", ".join(repr(w) for w in words)
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        kinds = [_describe(a) for a in args if a is not type(None)]
        nullable = ", or null" if type(None) in args else ""
        return " or ".join(k for k in kinds if k) + nullable
    if typing.get_origin(hint) in (list, tuple):
        return f"a list of {_describe(args[0]) if args else 'values'}"
    if typing.get_origin(hint) is dict:
        return "a mapping"
    return _KINDS.get(cast(type, hint), "")
