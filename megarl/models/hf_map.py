"""The declarative map between Hugging Face tensors and megatron-core parameters, and its transforms.

The table of each architecture comes from its model family (:mod:`megarl.models.families`); this
module applies it. Used by the model loader, checkpoints_tools and the hybrid engine. Transforms work on tensor-parallel *shards*:

- ``copy``:    one HF tensor, split along ``tp_dim`` (or replicated when ``tp_dim`` is None).
- ``qkv``:     HF q, k, v -> megatron's fused ``linear_qkv``: per query group ``[q_g; k_g; v_g]``
               rows; TP rank r holds the contiguous groups ``[r*G/tp, (r+1)*G/tp)``.
- ``gate_up``: HF gate, up -> megatron's fused ``linear_fc1``: TP rank r holds
               ``[gate_r; up_r]`` (its row slices of gate and of up, stacked).

Megatron names are those of the local (non-Transformer-Engine) layer spec, with the layer index
local to the pipeline stage, as ``GPTModel.named_parameters()`` reports them. Transformer
Engine's layer spec fuses each layer's two norms into the linear layer after them and names their
weights after it (:data:`TE_NORM_NAMES`), and on CUDA it builds a mixture of experts' local
experts as one grouped module (``mlp.experts.linear_fc1.weight<e>``); :func:`to_naming` converts
between the two namings and :class:`NameIndex` accepts both, so loading, export, the reshard and
the checkpoints work with either spec.
"""

from __future__ import annotations

import re
from typing import Protocol

import torch

from megarl.models.dims import ModelDims
from megarl.models.families.base import TensorMap
from megarl.models.families.dense import SCORE_BIAS, SCORE_WEIGHT


class SliceReader(Protocol):
    """Reads HF tensors, or a slice ``[start, stop)`` of them along one dimension, lazily."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int = 0
    ) -> torch.Tensor: ...


# The scalar heads' HF tensors (the critic's ``score`` has a bias, the reward model's not).
HEAD_MAPS: dict[str, tuple[TensorMap, ...]] = {
    "critic": (
        TensorMap("output_layer.weight", (SCORE_WEIGHT,), "copy", None),
        TensorMap("output_layer.bias", (SCORE_BIAS,), "copy", None),
    ),
    "reward": (TensorMap("output_layer.weight", (SCORE_WEIGHT,), "copy", None),),
}


def tensor_maps(dims: ModelDims, role: str = "actor") -> list[TensorMap]:
    """Every parameter of ``role``'s model, in HF order, from the family's `ModelFamily`
    (:mod:`megarl.models.families`). Actor and reference: ``output_layer`` is the LM head, listed
    even when tied (its HF name is then the embedding's). Critic and reward model: the same
    trunk, and the scalar head as ``score``."""
    spec = dims.model_family
    spec.check_role(role)
    return spec.tensor_maps(dims, role)


# The two layer specs megarl builds (megarl.models.build) name a layer's norm weights differently.
NAMINGS = ("local", "transformer_engine")
# local spec -> Transformer Engine spec, within ``decoder.layers.<i>.``
TE_NORM_NAMES: dict[str, str] = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LAYER_PREFIX = re.compile(r"^(.*decoder\.layers\.(?:\d+|\{layer\})\.)(.*)$")


# MoE experts: megatron's sequential experts (local spec) name an expert's weights
# ``mlp.experts.local_experts.<e>.linear_fc1.weight``; its grouped experts (TEGroupedMLP, which the
# Transformer Engine spec builds on CUDA) hold every local expert in one module, Transformer
# Engine's GroupedLinear, as ``mlp.experts.linear_fc1.weight<e>`` (the same [rows, cols] per
# expert). Both save the same dist-checkpoint keys (megatron's TEGroupedMLP.sharded_state_dict).
_SEQUENTIAL_EXPERT = re.compile(
    r"^mlp\.experts\.local_experts\.(\d+|\{expert\})\.(linear_fc[12])\.(weight|bias)$"
)
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+|\{expert\})$")


def to_naming(name: str, naming: str) -> str:
    """A megatron parameter name (or name-map template) as the ``naming`` layer spec spells it
    (the Transformer Engine spec's experts grouped)."""
    if naming not in NAMINGS:
        raise ValueError(f"unknown megatron naming {naming!r}; known: {NAMINGS}")
    m = _LAYER_PREFIX.match(name)
    if m is None:
        return name
    prefix, rest = m.groups()
    if naming == "transformer_engine":
        expert = _SEQUENTIAL_EXPERT.match(rest)
        if expert:
            index, module, kind = expert.groups()
            return f"{prefix}mlp.experts.{module}.{kind}{index}"
        return prefix + TE_NORM_NAMES.get(rest, rest)
    expert = _GROUPED_EXPERT.match(rest)
    if expert:
        module, kind, index = expert.groups()
        return f"{prefix}mlp.experts.local_experts.{index}.{module}.{kind}"
    local = {te: local for local, te in TE_NORM_NAMES.items()}
    return prefix + local.get(rest, rest)


def state_dict_to_naming(state: dict[str, torch.Tensor], naming: str) -> dict[str, torch.Tensor]:
    """The same tensors under ``naming``'s parameter names (order kept)."""
    return {to_naming(k, naming): v for k, v in state.items()}


class NameIndex:
    """Resolves a megatron parameter name (stage-local layer index), in either naming
    (:data:`NAMINGS`), to its map and HF names."""

    def __init__(
        self, dims: ModelDims, layer_offset: int = 0, role: str = "actor", expert_offset: int = 0
    ):
        self.dims = dims
        self.layer_offset = layer_offset
        # global index of this expert-parallel rank's first expert (MoE models)
        self.expert_offset = expert_offset
        self._patterns = [(_template_pattern(tm.megatron), tm) for tm in tensor_maps(dims, role)]

    def lookup(self, megatron_name: str) -> tuple[TensorMap, tuple[str, ...]]:
        local_name = to_naming(megatron_name, "local")
        for pattern, tm in self._patterns:
            m = pattern.match(local_name)
            if m:
                found = m.groupdict()
                layer = int(found["layer"]) + self.layer_offset if "layer" in found else None
                expert = int(found["expert"]) + self.expert_offset if "expert" in found else None
                return tm, tuple(h.format(layer=layer, expert=expert) for h in tm.hf)
        raise KeyError(
            f"megatron parameter {megatron_name!r} has no Hugging Face mapping for {self.dims.family}"
        )


def _template_pattern(template: str) -> re.Pattern[str]:
    """A regex matching a megatron name template, capturing ``{layer}`` and ``{expert}``."""
    escaped = re.escape(template)
    for key in ("layer", "expert"):
        escaped = escaped.replace(r"\{" + key + r"\}", f"(?P<{key}>\\d+)")
    return re.compile("^" + escaped + "$")


def _shard_bounds(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    step = size // tp_size
    return tp_rank * step, (tp_rank + 1) * step


def hf_to_megatron_shard(
    tm: TensorMap,
    hf_names: tuple[str, ...],
    reader: SliceReader,
    dims: ModelDims,
    tp_rank: int,
    tp_size: int,
) -> torch.Tensor:
    """The TP shard of one megatron parameter, reading only the HF rows/columns it needs."""
    if tm.kind == "copy":
        (name,) = hf_names
        if tm.tp_dim is None or tp_size == 1:
            return reader.read(name)
        start, stop = _shard_bounds(reader.shape(name)[tm.tp_dim], tp_rank, tp_size)
        return reader.read(name, tm.tp_dim, start, stop)
    if tm.kind == "qkv":
        groups = dims.num_kv_heads // tp_size
        q_per_group = dims.num_attention_heads // dims.num_kv_heads
        hd = dims.head_dim
        g0 = tp_rank * groups
        q = reader.read(hf_names[0], 0, g0 * q_per_group * hd, (g0 + groups) * q_per_group * hd)
        k = reader.read(hf_names[1], 0, g0 * hd, (g0 + groups) * hd)
        v = reader.read(hf_names[2], 0, g0 * hd, (g0 + groups) * hd)
        return fuse_qkv(q, k, v, groups)
    if tm.kind == "gate_up":
        # the gate's rows: the dense FFN size, or an expert's
        start, stop = _shard_bounds(reader.shape(hf_names[0])[0], tp_rank, tp_size)
        gate = reader.read(hf_names[0], 0, start, stop)
        up = reader.read(hf_names[1], 0, start, stop)
        return torch.cat([gate, up], dim=0)
    raise ValueError(f"unknown transform kind {tm.kind!r}")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Interleave q, k, v rows per query group: ``[q_0; k_0; v_0; q_1; k_1; v_1; ...]``."""
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(
    fused: torch.Tensor, dims: ModelDims, groups: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv` for the full (all TP shards concatenated) tensor, or for
    ``groups`` whole query groups of it."""
    groups = dims.num_kv_heads if groups is None else groups
    hd = dims.head_dim
    q_rows = dims.num_attention_heads // dims.num_kv_heads * hd
    rest = fused.shape[1:]
    per_group = fused.reshape(groups, q_rows + 2 * hd, *rest)
    q, k, v = per_group.split([q_rows, hd, hd], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


def split_qkv_shard(
    shard: torch.Tensor, dims: ModelDims, infer_tp: int, infer_rank: int
) -> list[tuple[torch.Tensor, int]]:
    """The q, k, v slices (with their first row in the HF tensor) of the fused attention rows that
    a rollout TP rank loads, as vLLM cuts them: whole query groups while ``infer_tp`` <= the KV
    heads; beyond that, the rank's share of one group's query heads stacked on that group's key
    and value heads (which the ranks sharing the group replicate)."""
    hd, kv = dims.head_dim, dims.num_kv_heads
    q_per_group = dims.num_attention_heads // kv
    if infer_tp <= kv:
        groups = kv // infer_tp
        g0 = infer_rank * groups
        q, k, v = split_qkv(shard, dims, groups)
        return [(q, g0 * q_per_group * hd), (k, g0 * hd), (v, g0 * hd)]
    sharing = infer_tp // kv
    group, part = divmod(infer_rank, sharing)
    own = q_per_group // sharing
    q, k, v = (t.contiguous() for t in shard.split([own * hd, hd, hd], dim=0))
    return [(q, (group * q_per_group + part * own) * hd), (k, group * hd), (v, group * hd)]


def megatron_shards_to_hf(
    tm: TensorMap, hf_names: tuple[str, ...], shards: list[torch.Tensor], dims: ModelDims
) -> list[tuple[str, torch.Tensor]]:
    """HF tensors from the TP shards (in TP-rank order) of one megatron parameter."""
    if tm.kind == "copy":
        full = shards[0] if tm.tp_dim is None or len(shards) == 1 else torch.cat(shards, tm.tp_dim)
        return [(hf_names[0], full)]
    if tm.kind == "qkv":
        q, k, v = split_qkv(torch.cat(shards, dim=0), dims)
        return list(zip(hf_names, (q, k, v), strict=True))
    if tm.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return [(hf_names[0], gate), (hf_names[1], up)]
    raise ValueError(f"unknown transform kind {tm.kind!r}")
