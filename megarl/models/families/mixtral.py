"""Mixtral: Llama-style attention (no q/k/v bias, no q/k norm) with every layer's MLP a routed
mixture of experts (``block_sparse_moe``: ``w1`` gate, ``w3`` up, ``w2`` down); the top-k
router probabilities are always renormalised."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from megarl.errors import UnsupportedModelError
from megarl.models.families.base import ModelFamily, MoeDims, register_family
from megarl.models.families.dense import HF_DEFAULT
from megarl.models.families.moe import MoEHFNames, moe_tensor_maps

MIXTRAL_NAMES = MoEHFNames(
    router="block_sparse_moe.gate.weight",
    expert="block_sparse_moe.experts.{expert}.",
    gate="w1.weight",
    up="w3.weight",
    down="w2.weight",
)


def _check(cfg: Mapping[str, object]) -> None:
    if cfg.get("sliding_window"):
        raise UnsupportedModelError(
            f"sliding-window attention (sliding_window={cfg['sliding_window']}) is not "
            "supported; set sliding_window to null in config.json (Mixtral 8x7B/8x22B ship it null)"
        )
    if cfg.get("router_jitter_noise"):
        raise UnsupportedModelError(
            "router_jitter_noise makes routing random in training; set it to 0.0 in config.json"
        )


def _moe_dims(cfg: Mapping[str, Any]) -> MoeDims:
    return {
        "num_experts": int(cfg["num_local_experts"]),
        "moe_ffn_hidden_size": int(cfg["intermediate_size"]),
        "moe_topk": int(cfg["num_experts_per_tok"]),
        "moe_norm_topk": True,
    }


def _config(hidden, layers, heads, kv, ffn, vocab, rope_theta, max_pos) -> dict[str, object]:
    return {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": ffn,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "max_position_embeddings": max_pos,
        "rope_theta": rope_theta,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "router_aux_loss_coef": 0.02,
    }


# Values from each model's public config.json.
KNOWN_MODELS = {
    "Mixtral-8x7B": _config(4096, 32, 32, 8, 14336, 32000, 1e6, 32768),
    "Mixtral-8x22B": _config(6144, 56, 48, 8, 16384, 32768, 1e6, 65536),
}

FAMILY = register_family(
    ModelFamily(
        name="mixtral",
        architectures=("MixtralForCausalLM",),
        tensor_maps=partial(moe_tensor_maps, names=HF_DEFAULT, moe_names=MIXTRAL_NAMES),
        qkv_bias=lambda cfg: False,
        check_config=_check,
        known_models=KNOWN_MODELS,
        description="Mixtral mixture of experts",
        moe_dims=_moe_dims,
    )
)
