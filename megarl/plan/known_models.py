"""Model shapes the planner knows by name, and reading a shape from a ``config.json``.

Each model family (:mod:`megarl.models.families`) lists the numbers of its models' public Hugging Face
``config.json`` that decide memory and layout (hidden size, layers, attention and KV heads, FFN
size, vocabulary, tied embeddings); the rest (QKV bias, q/k norm) follows from the architecture.
Instruct and base checkpoints of a size share these numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megarl.errors import ConfigError, UnsupportedModelError
from megarl.models.dims import ModelDims
from megarl.models.families import families


def _collect() -> dict[str, dict[str, object]]:
    """Canonical name -> config.json subset, from every model family's ``known_models``."""
    return {name: dict(cfg) for spec in families() for name, cfg in spec.known_models.items()}


KNOWN_MODELS: dict[str, dict[str, object]] = _collect()


def _key(name: str) -> str:
    """Lower-case, without an ``org/`` prefix, ``-Instruct`` suffix or ``Meta-`` prefix."""
    key = name.strip().split("/")[-1].lower()
    for suffix in ("-instruct",):
        if key.endswith(suffix):
            key = key[: -len(suffix)]
    if key.startswith("meta-"):
        key = key[len("meta-") :]
    return key


_BY_KEY = {_key(name): name for name in KNOWN_MODELS}


def known_model_names() -> list[str]:
    return list(KNOWN_MODELS)


def known_config(name: str) -> dict[str, object] | None:
    """The config.json subset of a known model (``Qwen/Qwen2.5-7B-Instruct`` works), else None."""
    canonical = _BY_KEY.get(_key(name))
    return dict(KNOWN_MODELS[canonical]) if canonical else None


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path} is not valid JSON ({e}); pass a Hugging Face config.json or its folder"
        ) from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} holds no JSON object; pass a Hugging Face config.json")
    return cfg


def resolve_model(spec: str) -> tuple[str, ModelDims]:
    """``(display name, dims)`` from a known name, a model folder, or a ``config.json`` path."""
    path = Path(spec).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(
                f"{path} has no config.json; pass a Hugging Face model folder (or its "
                f"config.json), or a known model name: {', '.join(KNOWN_MODELS)}"
            )
        return path.name, _dims(_read_config_file(cfg_file), str(cfg_file))
    if path.is_file():
        return path.parent.name or path.name, _dims(_read_config_file(path), str(path))
    cfg = known_config(spec)
    if cfg is not None:
        return _BY_KEY[_key(spec)], _dims(cfg, spec)
    # "org/name" is a hub-style model name; anything else with a slash is meant as a path.
    looks_like_path = (
        spec.count("/") > 1 or spec.startswith((".", "~", "/")) or spec.endswith(".json")
    )
    where = f"no file or folder {spec!r} exists" if looks_like_path else f"unknown model {spec!r}"
    raise ConfigError(
        f"{where}; pass a Hugging Face model folder or config.json path, or a known model name: "
        f"{', '.join(KNOWN_MODELS)}"
    )


def _dims(cfg: dict[str, Any], source: str) -> ModelDims:
    try:
        return ModelDims.from_hf_config(cfg)
    except UnsupportedModelError as e:
        raise ConfigError(f"{source}: {e}") from e
    except KeyError as e:
        raise ConfigError(
            f"{source} lacks {e.args[0]!r}; a Hugging Face config.json of a supported "
            f"architecture has it"
        ) from e
