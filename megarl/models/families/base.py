"""What megarl knows of one model architecture: a :class:`ModelFamily`, and the registry of them.

A family (``qwen2``, ``llama``, ``qwen3``, ...) is one module in this package that builds a
:class:`ModelFamily` and registers it. Everything else reads the family: the dims parser
(:mod:`megarl.models.dims`: which HF architectures map here, family-specific flags), the model
builder (megatron ``TransformerConfig`` options and layer-spec options), the name map (loading,
export, verify, checkpoints tools), the reshard tensor list and the planner's known models.

Pure: no torch, no megatron, and nothing of the rest of :mod:`megarl.models` (the families sit
below it), so a family reads the dims through the :class:`Dims` protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias, TypedDict

from megarl.errors import UnsupportedModelError

ROLES_ALL = ("actor", "reference", "critic", "reward")

# keyword arguments of megatron's TransformerConfig and layer-spec functions: plain values
MegatronOptions: TypeAlias = dict[str, int | float | str | bool | None]


class Dims(Protocol):
    """The model numbers a family reads (:class:`megarl.models.dims.ModelDims` has them; read-only,
    so frozen dataclasses match)."""

    @property
    def family(self) -> str: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def ffn_hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def qkv_bias(self) -> bool: ...
    @property
    def qk_layernorm(self) -> bool: ...
    # Mixture of experts (0 experts: a dense model; the rest is then unused).
    @property
    def num_experts(self) -> int: ...
    @property
    def moe_ffn_hidden_size(self) -> int: ...
    @property
    def moe_topk(self) -> int: ...
    @property
    def moe_norm_topk(self) -> bool: ...


class MoeDims(TypedDict, total=False):
    """The mixture-of-experts numbers of an HF config (none for a dense model)."""

    num_experts: int
    moe_ffn_hidden_size: int
    moe_topk: int
    moe_norm_topk: bool


@dataclass(frozen=True)
class TensorMap:
    """One megatron parameter and the HF tensors it is made of.

    ``kind`` names the transform (``copy``, ``qkv``, ``gate_up``: see :mod:`megarl.models.hf_map`);
    ``shape`` is the full (unsharded) megatron shape, ``tp_dim`` the dimension split over TP
    (for an expert's weight: over expert tensor parallelism).

    An expert's weight (``{expert}`` in its names) exists once per routed expert: megatron names
    it by its index among the experts of this expert-parallel rank, HF by its global index.
    """

    megatron: str  # template, "{layer}" = layer index local to the pipeline stage
    # templates, "{layer}" = global layer index, "{expert}" = global expert index
    hf: tuple[str, ...]
    kind: str  # "copy" | "qkv" | "gate_up"
    tp_dim: int | None  # dimension split over TP ranks in megatron (None: replicated)
    shape: tuple[int, ...] = field(default=(), compare=False)

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.megatron

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.megatron

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        """The shape one TP rank holds (the full shape when replicated)."""
        if self.tp_dim is None or tp == 1:
            return self.shape
        if self.shape[self.tp_dim] % tp:
            raise ValueError(
                f"{self.megatron}: dimension {self.tp_dim} of {self.shape} does not split over "
                f"tp={tp}"
            )
        out = list(self.shape)
        out[self.tp_dim] //= tp
        return tuple(out)


@dataclass(frozen=True)
class ModelFamily:
    """One architecture family.

    - ``architectures``: the HF ``*ForCausalLM`` names it reads (heads map to the same trunk).
    - ``qkv_bias(cfg)``: whether q/k/v projections carry a bias in this HF config.
    - ``qk_layernorm``: per-head RMSNorm on queries and keys before rope (megatron
      ``qk_layernorm``).
    - ``tensor_maps(dims, role)``: every megatron parameter of ``role`` with its HF names, transform
      and full shape, in HF order.
    - ``check_config(cfg)``: raises :class:`UnsupportedModelError` for options of this family that
      megarl does not implement.
    - ``roles``: the model roles (LM head or scalar heads) it supports.
    - ``known_models``: public configs by canonical name, for ``megarl plan``.
    - ``moe_dims(cfg)``: mixture-of-experts families only: the MoE numbers of an HF config
      (``num_experts``, ``moe_ffn_hidden_size``, ``moe_topk``, ``moe_norm_topk``), read the way the
      family's config names them.
    """

    name: str
    architectures: tuple[str, ...]
    tensor_maps: Callable[[Dims, str], list[TensorMap]]
    qkv_bias: Callable[[Mapping[str, object]], bool]
    qk_layernorm: bool = False
    check_config: Callable[[Mapping[str, object]], None] = lambda cfg: None
    roles: tuple[str, ...] = ROLES_ALL
    known_models: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    description: str = ""
    moe_dims: Callable[[Mapping[str, object]], MoeDims] | None = None

    @property
    def is_moe(self) -> bool:
        return self.moe_dims is not None

    def megatron_options(self, dims: Dims) -> MegatronOptions:
        """The ``TransformerConfig`` options that depend on the family (the rest are common)."""
        options: MegatronOptions = {
            "num_layers": dims.num_layers,
            "hidden_size": dims.hidden_size,
            "ffn_hidden_size": dims.ffn_hidden_size,
            "num_attention_heads": dims.num_attention_heads,
            "num_query_groups": dims.num_kv_heads,
            "kv_channels": dims.head_dim,
            "normalization": "RMSNorm",
            "gated_linear_unit": True,
            "add_bias_linear": False,
            "add_qkv_bias": dims.qkv_bias,
            "qk_layernorm": dims.qk_layernorm,
        }
        if dims.num_experts:
            options.update(moe_megatron_options(dims))
        return options

    def layer_spec_options(
        self, dims: Dims | None = None, grouped_gemm: bool = False
    ) -> MegatronOptions:
        """Keyword arguments of megatron's ``get_gpt_layer_*_spec`` for this family.

        MoE layers use megatron's sequential experts (one MLP per local expert, the names the
        tensor map knows), or with ``grouped_gemm`` (Transformer Engine's spec, on CUDA:
        :attr:`megarl.gpu_defaults.KernelOptions.moe_grouped_gemm`) its grouped experts, whose
        per-expert weights :func:`megarl.models.hf_map.to_naming` maps to the same names."""
        options: MegatronOptions = {"qk_layernorm": self.qk_layernorm}
        if dims is not None and dims.num_experts:
            options.update(num_experts=dims.num_experts, moe_grouped_gemm=grouped_gemm)
        return options

    def check_role(self, role: str) -> None:
        if role not in self.roles:
            raise UnsupportedModelError(
                f"the {self.name} family supports the roles {list(self.roles)}, not {role!r}"
            )


def moe_megatron_options(dims: Dims) -> MegatronOptions:
    """megatron's MoE options for a routed-experts layer as the HF families define it.

    Router: softmax over all experts then top-k without renormalising (``pre_softmax``), or
    top-k logits then a softmax over those k, which equals renormalising the top-k probabilities
    (``moe_norm_topk``: Mixtral, Qwen3-MoE with ``norm_topk_prob``). No capacity factor: no token
    is ever dropped, so rollout and training compute the same function. Router in fp32. The
    token dispatcher (all-to-all) is set for every model by the builder.
    """
    return {
        "num_moe_experts": dims.num_experts,
        "moe_ffn_hidden_size": dims.moe_ffn_hidden_size,
        "moe_router_topk": dims.moe_topk,
        "moe_router_pre_softmax": not dims.moe_norm_topk,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_grouped_gemm": False,
        "moe_expert_capacity_factor": None,
        "moe_permute_fusion": False,
    }


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(model_family: ModelFamily) -> ModelFamily:
    """Add a family; its architectures must not already belong to another one."""
    for other in _FAMILIES.values():
        clash = set(other.architectures) & set(model_family.architectures)
        if other.name != model_family.name and clash:
            raise ValueError(f"architectures {sorted(clash)} already belong to {other.name!r}")
    _FAMILIES[model_family.name] = model_family
    return model_family


def unregister_family(name: str) -> None:
    _FAMILIES.pop(name, None)


def family(name: str) -> ModelFamily:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise UnsupportedModelError(
            f"unknown model family {name!r}; known: {sorted(_FAMILIES)}"
        ) from None


def families() -> list[ModelFamily]:
    return list(_FAMILIES.values())


def supported_architectures() -> dict[str, str]:
    """HF architecture name -> family name, for every registered family."""
    return {
        arch: model_family.name
        for model_family in _FAMILIES.values()
        for arch in model_family.architectures
    }


def family_for_architectures(
    archs: list[str], model_type: str | None = None
) -> tuple[str, ModelFamily]:
    """``(architecture, family)`` of the first supported name in ``archs``; else an error naming
    the supported ones."""
    table = supported_architectures()
    for arch in archs:
        if arch in table:
            return arch, _FAMILIES[table[arch]]
    raise UnsupportedModelError(
        f"unsupported architecture {archs or model_type!r}; megarl supports "
        f"{sorted(table)} (families: {', '.join(sorted(_FAMILIES))})"
    )
