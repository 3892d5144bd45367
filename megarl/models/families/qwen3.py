"""Qwen3 dense: per-head RMSNorm on queries and keys (HF ``q_norm``/``k_norm``, megatron
``qk_layernorm``), an explicit ``head_dim`` (often not hidden/heads), no q/k/v bias unless
``attention_bias``; embeddings tied in the small sizes."""

from __future__ import annotations

from collections.abc import Mapping

from megarl.errors import UnsupportedModelError
from megarl.models.families.base import ModelFamily, register_family
from megarl.models.families.dense import dense_tensor_maps


def _check(cfg: Mapping[str, object]) -> None:
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError(
            "sliding-window attention (use_sliding_window=true) is not supported; "
            "set it to false in config.json (Qwen3 checkpoints ship it disabled)"
        )


def _config(hidden, layers, heads, kv, ffn, tied) -> dict[str, object]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "intermediate_size": ffn,
        "vocab_size": 151936,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "use_sliding_window": False,
    }


# Values from each model's public config.json.
KNOWN_MODELS = {
    "Qwen3-0.6B": _config(1024, 28, 16, 8, 3072, True),
    "Qwen3-1.7B": _config(2048, 28, 16, 8, 6144, True),
    "Qwen3-4B": _config(2560, 36, 32, 8, 9728, True),
    "Qwen3-8B": _config(4096, 36, 32, 8, 12288, False),
    "Qwen3-14B": _config(5120, 40, 40, 8, 17408, False),
    "Qwen3-32B": _config(5120, 64, 64, 8, 25600, False),
}

FAMILY = register_family(
    ModelFamily(
        name="qwen3",
        architectures=("Qwen3ForCausalLM",),
        tensor_maps=dense_tensor_maps,
        qkv_bias=lambda cfg: bool(cfg.get("attention_bias", False)),
        qk_layernorm=True,
        check_config=_check,
        known_models=KNOWN_MODELS,
        description="Qwen3 dense",
    )
)
