"""The reshard planner's tensor list for an actor model, from its model family's tensor map.

The planner (:mod:`megarl.weights.reshard_schedule`) receives these :class:`PlannedTensor` and knows
nothing of models; shapes, TP split dimensions and HF order come from the model family
(:mod:`megarl.models.families`), as :func:`megarl.models.hf_map.tensor_maps` gives it; torch is not
imported, so ``megarl plan`` can plan the reshard of any layout cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence

from megarl.models.dims import ModelDims
from megarl.models.families import TensorMap
from megarl.weights.reshard_schedule import EVEN, PlannedTensor, ShardRule

# vLLM pads the vocabulary to a multiple of this before splitting it over its TP ranks
# (``vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE``).
VLLM_VOCAB_PADDING = 64


def shard_rule(tm: TensorMap, dims: ModelDims) -> ShardRule:
    """How vLLM cuts this tensor over its TP ranks (shard mode): the vocabulary padded, the
    fused attention rows by query group (key/value heads replicated when the rollout TP exceeds
    them), everything else evenly."""
    if tm.megatron in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return ShardRule("padded", pad_to=VLLM_VOCAB_PADDING)
    if tm.kind == "qkv":
        hd = dims.head_dim
        return ShardRule("grouped", groups=dims.num_kv_heads, shared_rows=2 * hd, head_rows=hd)
    return EVEN


def update_group(name: str, layer: int | None) -> str:
    """The weight-update group of a tensor: its whole transformer layer (every module of it,
    every expert of an MoE layer), or, outside the layers, its module.

    vLLM's in-place reload (``reload_weights``; model_loader/reload/layerwise.py and meta.py in
    0.32 and 0.33) rebuilds each module from meta tensors when a call starts and processes it
    once the call has loaded all of its elements; a module one call loads only in part is
    processed at the call's end from the memory it was rebuilt in, so what that call did not
    bring is uninitialised, and it is copied back whole over the module's weights. A fused MoE
    module holds all experts of its layer: its tensors must all come in one call. The reshard
    hands vLLM one bucket per call and never splits a group across buckets, so every call
    brings whole layers, whatever the bucket size says (a layer larger than a bucket travels
    alone)."""
    if layer is not None:
        return f"decoder.layers.{layer}"
    return name.rsplit(".", 1)[0]


def megatron_global_name(template: str, layer: int | None, expert: int | None = None) -> str:
    return template.format(layer=layer, expert=expert) if layer is not None else template


def actor_planned_tensors(
    dims: ModelDims, layers_per_stage: Sequence[int], itemsize: int = 4, ep: int = 1
) -> list[PlannedTensor]:
    """Every actor tensor that the rollout engine needs, in HF order, as planner specs.

    Names are megatron names with *global* layer indices (the fused gate/up weight as
    ``...linear_fc1.weight#0`` (gate) and ``#1`` (up), so each part splits as one contiguous range
    per TP rank), each with vLLM's split over its TP ranks (:func:`shard_rule`). The tied output
    layer is left out (vLLM ties it to the embedding). An MoE
    layer's expert weights appear once per expert, under the *global* expert index, held by the
    expert-parallel rank ``expert // (experts / ep)``. Each tensor's ``group`` is its
    :func:`update_group` (its layer), so a bucket, and with it a rollout weight update, holds
    whole layers.
    """
    pp = len(layers_per_stage)
    stage_of_layer = [s for s, n in enumerate(layers_per_stage) for _ in range(n)]
    if len(stage_of_layer) != dims.num_layers:
        raise ValueError(
            f"layers per stage {list(layers_per_stage)} do not sum to {dims.num_layers} layers"
        )
    maps = dims.model_family.tensor_maps(dims, "actor")  # as hf_map.tensor_maps, without torch
    specs: list[PlannedTensor] = []

    per_rank = dims.num_experts // ep if dims.is_moe else 1

    def add(tm: TensorMap, layer: int | None, stage: int, expert: int | None = None) -> None:
        name = megatron_global_name(tm.megatron, layer, expert)
        holder = None if expert is None else expert // per_rank
        rule = shard_rule(tm, dims)
        group = update_group(name, layer)
        if tm.kind == "gate_up":
            rows, *rest = tm.shape
            part_shape = (rows // 2, *rest)
            for part in (0, 1):
                specs.append(
                    PlannedTensor(
                        f"{name}#{part}",
                        part_shape,
                        tm.tp_dim,
                        stage,
                        itemsize,
                        group,
                        holder,
                        rule,
                    )
                )
        else:
            specs.append(
                PlannedTensor(name, tm.shape, tm.tp_dim, stage, itemsize, group, holder, rule)
            )

    # HF order: embeddings, layer by layer, final norm, head.
    for tm in maps:
        if tm.megatron == "embedding.word_embeddings.weight":
            add(tm, None, 0)
    for layer in range(dims.num_layers):
        for tm in maps:
            if tm.per_layer:
                for expert in range(dims.num_experts) if tm.per_expert else [None]:
                    add(tm, layer, stage_of_layer[layer], expert)
    for tm in maps:
        head = tm.megatron == "output_layer.weight" and not dims.tie_word_embeddings
        if tm.megatron == "decoder.final_layernorm.weight" or head:
            add(tm, None, pp - 1)
    return specs
