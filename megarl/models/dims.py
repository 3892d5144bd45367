"""Model dimensions read from a Hugging Face ``config.json``, and the architectures megarl supports.

Pure: no torch, no megatron. Used by model building, layout validation and the memory planner.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.errors import CheckpointError, UnsupportedModelError
from megarl.models.families import ModelFamily, family, family_for_architectures
from megarl.models.families.base import MoeDims
from megarl.models.heads import causal_architecture
from megarl.parallel import ModelShape, ParallelLayout


@dataclass(frozen=True)
class ModelDims:
    family: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    # llama3-style rope scaling factor (None: no scaling).
    rope_scaling_factor: float | None = None
    # Per-head RMSNorm on queries and keys (Qwen3).
    qk_layernorm: bool = False
    # Mixture of experts (Qwen3-MoE, Mixtral): routed experts per layer (0: dense), each expert's
    # FFN size, experts per token, and whether the top-k router probabilities are renormalised.
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    moe_norm_topk: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def model_family(self) -> ModelFamily:
        """The family's definition (megarl.models.families): name map, megatron options, roles."""
        return family(self.family)

    @property
    def shape(self) -> ModelShape:
        return ModelShape(
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads,
            vocab_size=self.vocab_size,
            # what TP (expert TP for an MoE model) splits
            ffn_hidden_size=self.moe_ffn_hidden_size if self.is_moe else self.ffn_hidden_size,
            num_experts=self.num_experts,
        )

    @property
    def num_parameters(self) -> int:
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        attn += 2 * self.head_dim if self.qk_layernorm else 0
        mlp = (
            self.num_experts * (3 * h * self.moe_ffn_hidden_size + h) if self.is_moe else 3 * h * f
        )
        per_layer = attn + mlp + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelDims:

        archs = [causal_architecture(a) for a in cfg.get("architectures") or []]
        arch, model_family = family_for_architectures(archs, cfg.get("model_type"))
        model_family.check_config(cfg)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"hidden_act={act!r} is not supported; megarl supports 'silu'"
            )
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError(
                "mlp_bias=true is not supported (no checkpoint of a supported family uses it)"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        scaling = None
        if rope_type == "llama3":
            scaling = float(rope["factor"])
        elif rope_type != "default":
            raise UnsupportedModelError(
                f"rope scaling type {rope_type!r} is not supported; supported: 'default', 'llama3'"
            )
        return cls(
            family=model_family.name,
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_family.qkv_bias(cfg),
            rope_scaling_factor=scaling,
            qk_layernorm=model_family.qk_layernorm,
            **_moe_dims(model_family, cfg),
        )

    @classmethod
    def from_pretrained(cls, hf_dir: str | Path) -> ModelDims:
        return cls.from_hf_config(read_hf_config(hf_dir))


def _moe_dims(model_family: ModelFamily, cfg: dict[str, object]) -> MoeDims:
    """The MoE numbers of an MoE family's config (empty for a dense family), validated."""
    if model_family.moe_dims is None:
        return {}
    moe = model_family.moe_dims(cfg)
    if moe["num_experts"] < 1 or not 1 <= moe["moe_topk"] <= moe["num_experts"]:
        raise UnsupportedModelError(
            f"{model_family.name}: config.json gives {moe['num_experts']} experts with "
            f"{moe['moe_topk']} per token; need at least one expert and 1 <= "
            "num_experts_per_tok <= the number of experts"
        )
    return moe


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir)
    if not path.is_dir():
        raise CheckpointError(
            f"model folder {path} does not exist; pass a local Hugging Face model folder"
        )
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(
            f"{cfg_file} is missing; a Hugging Face model folder needs its config.json"
        )
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{cfg_file} is not valid JSON ({e}); re-download or re-export the model"
        ) from e


def layer_offset(dims: ModelDims, layout: ParallelLayout, pp_rank: int) -> int:
    """Global index of the first layer held by pipeline stage ``pp_rank``."""
    return sum(layout.layers_per_stage(dims.num_layers)[:pp_rank])


def expert_offset(dims: ModelDims, ep_rank: int, ep_size: int) -> int:
    """Global index of the first routed expert held by expert-parallel rank ``ep_rank``."""
    return ep_rank * (dims.num_experts // ep_size) if dims.is_moe else 0
