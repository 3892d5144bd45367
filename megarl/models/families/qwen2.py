"""Qwen2 / Qwen2.5: dense decoder with q/k/v bias, no q/k norm."""

from __future__ import annotations

from collections.abc import Mapping

from megarl.errors import UnsupportedModelError
from megarl.models.families.base import ModelFamily, register_family
from megarl.models.families.dense import dense_tensor_maps


def _check(cfg: Mapping[str, object]) -> None:
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError(
            "sliding-window attention (use_sliding_window=true) is not supported; "
            "set it to false in config.json (Qwen2.5 checkpoints ship it disabled)"
        )


def _config(hidden, layers, heads, kv, ffn, vocab, tied) -> dict[str, object]:
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


# Values from each model's public config.json (instruct and base share them).
KNOWN_MODELS = {
    "Qwen2.5-0.5B": _config(896, 24, 14, 2, 4864, 151936, True),
    "Qwen2.5-1.5B": _config(1536, 28, 12, 2, 8960, 151936, True),
    "Qwen2.5-7B": _config(3584, 28, 28, 4, 18944, 152064, False),
    "Qwen2.5-14B": _config(5120, 48, 40, 8, 13824, 152064, False),
    "Qwen2.5-32B": _config(5120, 64, 40, 8, 27648, 152064, False),
    "Qwen2.5-72B": _config(8192, 80, 64, 8, 29568, 152064, False),
}

FAMILY = register_family(
    ModelFamily(
        name="qwen2",
        architectures=("Qwen2ForCausalLM",),
        tensor_maps=dense_tensor_maps,
        qkv_bias=lambda cfg: True,
        check_config=_check,
        known_models=KNOWN_MODELS,
        description="Qwen2/Qwen2.5",
    )
)
