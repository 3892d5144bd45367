"""Scalar heads: the roles whose output layer is one number per token instead of the LM head.

- ``critic``: a value per token, saved in Hugging Face as ``*ForTokenClassification`` with one
  label (``score`` linear layer with bias); a fresh head starts at zero.
- ``reward``: a reward model, read at the last token of each sequence; saved as
  ``*ForSequenceClassification`` with one label (``score`` linear layer without bias, as
  transformers builds it); a fresh head starts from a seeded normal so the trunk gets gradients
  from the first Bradley-Terry step.

Pure (no torch): used by the model builder, the loaders and checkpoints_tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.errors import UnsupportedModelError

CAUSAL_SUFFIX = "ForCausalLM"


@dataclass(frozen=True)
class ScalarHead:
    role: str
    hf_suffix: str  # the Hugging Face architecture suffix of a folder holding this head
    bias: bool
    fresh_init: str  # "zeros" | "normal"
    init_std: float = 0.02
    init_seed: int = 1234  # identical on every rank: the head is replicated over TP


SCALAR_HEADS: dict[str, ScalarHead] = {
    "critic": ScalarHead("critic", "ForTokenClassification", bias=True, fresh_init="zeros"),
    "reward": ScalarHead("reward", "ForSequenceClassification", bias=False, fresh_init="normal"),
}


def has_scalar_head(role: str) -> bool:
    return role in SCALAR_HEADS


def causal_architecture(name: str) -> str:
    """``Qwen2ForSequenceClassification`` -> ``Qwen2ForCausalLM`` (same trunk and dims)."""
    for head in SCALAR_HEADS.values():
        if name.endswith(head.hf_suffix):
            return name[: -len(head.hf_suffix)] + CAUSAL_SUFFIX
    return name


def head_architecture(causal_name: str, role: str) -> str:
    """``Qwen2ForCausalLM`` -> the architecture name of ``role``'s Hugging Face export."""
    if not has_scalar_head(role) or not causal_name.endswith(CAUSAL_SUFFIX):
        return causal_name
    return causal_name[: -len(CAUSAL_SUFFIX)] + SCALAR_HEADS[role].hf_suffix


def hf_folder_role(cfg: dict[str, Any]) -> str:
    """The role a Hugging Face config describes: ``critic``, ``reward`` or ``actor``."""
    archs = cfg.get("architectures") or []
    for head in SCALAR_HEADS.values():
        if any(a.endswith(head.hf_suffix) for a in archs):
            labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
            if labels != 1:
                raise UnsupportedModelError(
                    f"{archs[0]} with {labels} labels is not a scalar {head.role} model; megarl "
                    f"reads exactly one output (num_labels=1)"
                )
            return head.role
    return "actor"
