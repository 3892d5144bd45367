"""The keys of a config layer (a YAML file, or the ``key=value`` overrides) checked against the
typed schema before OmegaConf merges them: every unknown key is named in full, with a suggestion
(a close megarl key, or megarl's key for one of verl's), and a single value where the schema wants
a list (``data.train_files=/x.parquet``) is taken as a one-element list.

Pure: the schema is the dataclass passed in (``megarl.config.RunConfig``), nothing is imported
from the config module, so it can use these functions without a cycle.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import is_dataclass
from typing import TypeGuard

from megarl.errors import ConfigError
from megarl.verl_keys import verl_hint


def _field_types(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _is_section(tp: object) -> TypeGuard[type]:
    """A field whose type is a dataclass: a section of the schema."""
    return isinstance(tp, type) and is_dataclass(tp)


def _is_list(tp: object) -> bool:
    if typing.get_origin(tp) is list:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_list(a) for a in typing.get_args(tp))
    return False


def _is_mapping(tp: object) -> bool:
    return typing.get_origin(tp) is dict or tp is dict


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included."""
    keys = []
    for name, tp in _field_types(cls).items():
        keys.append(f"{prefix}{name}")
        if _is_section(tp):
            keys += all_keys(tp, f"{prefix}{name}.")
    return keys


def _leaves(tree: Mapping[str, object], prefix: str) -> Iterator[str]:
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def prepare_layer(cls: type, tree: dict[str, object], prefix: str = "") -> list[str]:
    """Take single values as one-element lists where ``cls`` wants a list (in place); return the
    unknown keys of ``tree`` in full (``a.b.c``, not the first unknown level)."""
    types_ = _field_types(cls)
    unknown: list[str] = []
    for key in list(tree):
        value, full = tree[key], f"{prefix}{key}"
        if key not in types_:
            unknown += list(_leaves(value, f"{full}.")) if isinstance(value, Mapping) else [full]
            continue
        tp = types_[key]
        if _is_section(tp):
            if isinstance(value, dict):
                unknown += prepare_layer(tp, value, f"{full}.")
        elif _is_mapping(tp):
            continue  # free-form keyword arguments (e.g. algorithm.policy_loss_kwargs)
        elif isinstance(value, Mapping) and value:
            unknown += list(_leaves(value, f"{full}."))  # a scalar setting given sub-keys
        elif _is_list(tp) and isinstance(value, str | int | float | bool):
            tree[key] = [value]
    return unknown


def move_keys(tree: dict[str, object], moved: Mapping[str, str], source: str) -> None:
    """Move each old dotted key of ``moved`` that ``tree`` (one config layer, nested) holds to
    its new key, in place, so configs written before a setting moved keep loading. A layer that
    gives one setting under both keys is refused: which one it meant is not known."""
    for old, new in moved.items():
        *old_path, old_name = old.split(".")
        parent = _subtree(tree, old_path)
        if parent is None or old_name not in parent:
            continue
        value = parent.pop(old_name)
        *new_path, new_name = new.split(".")
        target: dict[str, object] = tree
        for part in new_path:
            child = target.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(new_path)} is a section of settings (in {source})")
            target = child
        if new_name in target:
            raise ConfigError(
                f"{old} and {new} are one setting, given twice (in {source}); keep {new}, "
                f"the setting's key since it moved"
            )
        target[new_name] = value


def _subtree(tree: dict[str, object], path: list[str]) -> dict[str, object] | None:
    node: object = tree
    for part in path:
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node if isinstance(node, dict) else None


def suggestion(cls: type, key: str, moved: Mapping[str, str] | None = None) -> str:
    """Why ``key`` is unknown and what to write instead (``moved``: old key -> new key, so a
    misspelt old key is answered with the setting's key now)."""
    if key == "algorithm.tis_cap":
        return (
            f"{key!r}: it is replaced by the rollout corrections: set "
            "algorithm.rollout_correction=token_tis and algorithm.rollout_correction_kwargs.cap="
            "<the cap> (e.g. 2.0); seq_tis, masked_is, icepop and decoupled_ppo are the others"
        )
    if key.startswith("critic.lora"):
        return (
            f"{key!r}: LoRA is for the actor only (actor.lora.*); the critic trains all its weights"
        )
    verl = verl_hint(key)
    if verl is not None:
        return verl
    now = {k: k for k in all_keys(cls)} | dict(moved or {})
    close = difflib.get_close_matches(key, list(now), n=3, cutoff=0.6)
    if close:
        return f"{key!r}; did you mean {', '.join(dict.fromkeys(now[c] for c in close))}?"
    return f"{key!r}"


def unknown_keys_error(
    cls: type, keys: list[str], source: str, moved: Mapping[str, str] | None = None
) -> ConfigError:
    """Every key of ``keys`` named with its suggestion, in one message (one line for one key,
    one line per key for several: a whole verl YAML file is answered in one round)."""
    where = f"(in {source}). `megarl config --show` lists every setting and its default"
    if len(keys) == 1:
        return ConfigError(f"unknown setting {suggestion(cls, keys[0], moved)} {where}")
    lines = "".join(f"\n  {suggestion(cls, k, moved)}" for k in keys)
    return ConfigError(f"{len(keys)} unknown settings {where}:{lines}")
