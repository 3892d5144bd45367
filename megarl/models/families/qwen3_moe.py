"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm, explicit head_dim, no q/k/v bias) with every
layer's MLP a routed mixture of experts (no shared expert); the top-k probabilities are
renormalised only when ``norm_topk_prob`` (the public checkpoints set it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megarl.errors import UnsupportedModelError
from megarl.models.families.base import ModelFamily, MoeDims, register_family
from megarl.models.families.moe import moe_tensor_maps


def _check(cfg: Mapping[str, Any]) -> None:
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError(
            "sliding-window attention (use_sliding_window=true) is not supported; "
            "set it to false in config.json (Qwen3-MoE checkpoints ship it disabled)"
        )
    step = int(cfg.get("decoder_sparse_step", 1))
    if step != 1 or cfg.get("mlp_only_layers"):
        raise UnsupportedModelError(
            f"Qwen3-MoE with dense layers among the MoE ones (decoder_sparse_step={step}, "
            f"mlp_only_layers={cfg.get('mlp_only_layers')}) is not supported; megarl supports "
            "decoder_sparse_step=1 and mlp_only_layers=[] (as the public checkpoints ship)"
        )


def _moe_dims(cfg: Mapping[str, Any]) -> MoeDims:
    # transformers 5 writes ``num_local_experts``; the public config.json files ``num_experts``.
    return {
        "num_experts": int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
        "moe_ffn_hidden_size": int(cfg["moe_intermediate_size"]),
        "moe_topk": int(cfg["num_experts_per_tok"]),
        "moe_norm_topk": bool(cfg.get("norm_topk_prob", False)),
    }


def _config(hidden, layers, heads, kv, ffn, moe_ffn, experts, topk) -> dict[str, object]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "intermediate_size": ffn,
        "moe_intermediate_size": moe_ffn,
        "num_experts": experts,
        "num_experts_per_tok": topk,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "use_sliding_window": False,
        "router_aux_loss_coef": 0.001,
    }


# Values from each model's public config.json.
KNOWN_MODELS = {
    "Qwen3-30B-A3B": _config(2048, 48, 32, 4, 6144, 768, 128, 8),
    "Qwen3-235B-A22B": _config(4096, 94, 64, 4, 12288, 1536, 128, 8),
}

FAMILY = register_family(
    ModelFamily(
        name="qwen3_moe",
        architectures=("Qwen3MoeForCausalLM",),
        tensor_maps=moe_tensor_maps,
        qkv_bias=lambda cfg: bool(cfg.get("attention_bias", False)),
        qk_layernorm=True,
        check_config=_check,
        known_models=KNOWN_MODELS,
        description="Qwen3 mixture of experts",
        moe_dims=_moe_dims,
    )
)
