"""Model shapes the planner knows by name, and reading a shape from a ``config.json``.

The table holds the numbers of each model's public Hugging Face ``config.json`` that decide memory
and layout (nothing else is needed to plan): hidden size, layers, attention and KV heads, FFN
size, vocabulary, tied embeddings; QKV bias follows from the architecture (Qwen2 has it, Llama
not). Instruct and base checkpoints of a size share these numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megarl.errors import ConfigError, UnsupportedModelError
from megarl.models.dims import ModelDims


def _qwen2(hidden, layers, heads, kv, ffn, vocab, tied) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
    }


def _llama(
    hidden, layers, heads, kv, ffn, vocab, tied, *, rope_theta, llama31=False, head_dim=None
):
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 131072 if llama31 else 8192,
        "rope_theta": rope_theta,
        "rms_norm_eps": 1e-5,
    }
    if llama31:
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    return cfg


# Canonical name -> config.json subset (values from each model's public config.json).
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": _qwen2(896, 24, 14, 2, 4864, 151936, True),
    "Qwen2.5-1.5B": _qwen2(1536, 28, 12, 2, 8960, 151936, True),
    "Qwen2.5-7B": _qwen2(3584, 28, 28, 4, 18944, 152064, False),
    "Qwen2.5-14B": _qwen2(5120, 48, 40, 8, 13824, 152064, False),
    "Qwen2.5-32B": _qwen2(5120, 64, 40, 8, 27648, 152064, False),
    "Qwen2.5-72B": _qwen2(8192, 80, 64, 8, 29568, 152064, False),
    "Llama-3-8B": _llama(4096, 32, 32, 8, 14336, 128256, False, rope_theta=500000.0),
    "Llama-3-70B": _llama(8192, 80, 64, 8, 28672, 128256, False, rope_theta=500000.0),
    "Llama-3.1-8B": _llama(
        4096, 32, 32, 8, 14336, 128256, False, rope_theta=500000.0, llama31=True
    ),
    "Llama-3.1-70B": _llama(
        8192, 80, 64, 8, 28672, 128256, False, rope_theta=500000.0, llama31=True
    ),
    "Llama-3.1-405B": _llama(
        16384, 126, 128, 8, 53248, 128256, False, rope_theta=500000.0, llama31=True
    ),
    "SmolLM2-135M": _llama(576, 30, 9, 3, 1536, 49152, True, rope_theta=100000.0, head_dim=64),
}


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


def known_config(name: str) -> dict[str, Any] | None:
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
            f"{source} lacks {e.args[0]!r}; a Hugging Face config.json of a Qwen2 or Llama model "
            f"has it"
        ) from e
