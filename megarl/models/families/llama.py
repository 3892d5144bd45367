"""Llama 2/3/3.1 (and SmolLM2): dense decoder, q/k/v bias only when ``attention_bias``."""

from __future__ import annotations

from megarl.models.families.base import ModelFamily, register_family
from megarl.models.families.dense import dense_tensor_maps


def _config(
    hidden, layers, heads, kv, ffn, vocab, tied, *, rope_theta, llama31=False, head_dim=None
) -> dict[str, object]:
    cfg: dict[str, object] = {
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


KNOWN_MODELS = {
    "Llama-3-8B": _config(4096, 32, 32, 8, 14336, 128256, False, rope_theta=500000.0),
    "Llama-3-70B": _config(8192, 80, 64, 8, 28672, 128256, False, rope_theta=500000.0),
    "Llama-3.1-8B": _config(
        4096, 32, 32, 8, 14336, 128256, False, rope_theta=500000.0, llama31=True
    ),
    "Llama-3.1-70B": _config(
        8192, 80, 64, 8, 28672, 128256, False, rope_theta=500000.0, llama31=True
    ),
    "Llama-3.1-405B": _config(
        16384, 126, 128, 8, 53248, 128256, False, rope_theta=500000.0, llama31=True
    ),
    "SmolLM2-135M": _config(576, 30, 9, 3, 1536, 49152, True, rope_theta=100000.0, head_dim=64),
}

FAMILY = register_family(
    ModelFamily(
        name="llama",
        architectures=("LlamaForCausalLM",),
        tensor_maps=dense_tensor_maps,
        qkv_bias=lambda cfg: bool(cfg.get("attention_bias", False)),
        known_models=KNOWN_MODELS,
        description="the Llama family",
    )
)
