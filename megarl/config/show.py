"""``megarl config --show [CONFIG] [key=value ...]``: every setting of the schema with its value
(the defaults, the YAML file and the overrides merged) and its default, in the schema's order."""

from __future__ import annotations

import json
import typing
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from megarl.config.loading import merged_config
from megarl.config.moved_keys import MOVED_KEYS
from megarl.config.schema import RunConfig

REQUIRED = "(required)"


def leaf_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every setting's dotted key (sections left out), in the schema's order."""
    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        if isinstance(tp, type) and is_dataclass(tp):
            keys += leaf_keys(tp, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _text(node: DictConfig, key: str) -> str:
    parent, _, name = key.rpartition(".")
    holder = OmegaConf.select(node, parent) if parent else node
    if OmegaConf.is_missing(holder, name):
        return REQUIRED
    value: Any = OmegaConf.select(node, key)
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, str) and "\n" not in value:
        return value
    return json.dumps(value)  # a text of several lines on one line, as YAML also reads it


def settings(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> list[tuple[str, str, str]]:
    """(key, value, default) of every setting, values as YAML would read them."""
    merged = merged_config(path, overrides)
    defaults = OmegaConf.structured(RunConfig)
    return [(k, _text(merged, k), _text(defaults, k)) for k in leaf_keys()]


def markdown() -> str:
    """docs/configuration.md: every setting and its default, one table per section, generated
    from the schema (``python -m megarl.config.show > docs/configuration.md``)."""
    out = [
        "# Every setting and its default",
        "",
        "Generated from the schema (`megarl/config/schema.py`, whose comments say what each one",
        "does) by `python -m megarl.config.show > docs/configuration.md`; a test keeps the two",
        "equal. `megarl config --show [CONFIG] [key=value ...]` prints the same list with a run's",
        "values; a run keeps the values it used in `OUTPUT/config.yaml`.",
    ]
    section = None
    for key, _, default in settings():
        top = key.split(".", 1)[0]
        if top != section:
            section = top
            out += ["", f"## {section}", "", "| setting | default |", "| --- | --- |"]
        out.append(f"| `{key}` | `{default}` |")
    out += [
        "",
        "## Keys that moved",
        "",
        "The rollout's settings were split into sections by concern. Configs, overrides and earlier",
        "runs' `config.yaml` written with the old keys still load: each old key is read as its new",
        "one (giving both in one file or one command line is refused).",
        "",
        "| old key | now |",
        "| --- | --- |",
        *(f"| `{old}` | `{new}` |" for old, new in MOVED_KEYS.items()),
    ]
    return "\n".join(out) + "\n"


def show(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The table ``megarl config --show`` prints: a changed setting is marked ``*``."""
    rows = settings(path, overrides)
    width = max(len(k) for k, _, _ in rows)
    vwidth = min(40, max(len(v) for _, v, _ in rows))
    source = " + ".join(([str(path)] if path else []) + (["overrides"] if overrides else []))
    lines = [
        f"# every megarl setting: value ({source or 'the defaults'}), default; * = changed",
        f"  {'setting':<{width}}  {'value':<{vwidth}}  default",
    ]
    for key, value, default in rows:
        mark = "*" if value != default else " "
        lines.append(f"{mark} {key:<{width}}  {value:<{vwidth}}  {default}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
