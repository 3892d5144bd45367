"""How many parameters one rank holds: one pipeline stage of a model, its TP-split share.

Counts follow megatron's GPTModel as megarl builds it (fused QKV with optional bias, fused
gate/up, RMSNorm weights replicated over TP, vocabulary-parallel embedding and output layer). With
tied embeddings and PP > 1 the last stage holds its own copy of the output weight; with PP = 1
the model holds one. A critic's output is a value head (hidden + 1 values) instead.

Mixture of experts: each layer's experts are split over expert parallelism (``ep`` ranks hold
``experts / ep`` each) and each expert over expert TP (= TP); the router (experts x hidden) is
replicated. Per token only ``topk`` experts compute (:func:`flops_params`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.models.dims import ModelDims


@dataclass(frozen=True)
class StageParams:
    """Parameters (elements) one rank of one pipeline stage holds."""

    layers: int  # transformer layers on this stage
    total: int
    largest: int  # the largest single tensor: bounds per-tensor temporaries
    vocab: int  # embedding / output-layer elements on this rank (vocabulary-parallel)
    shared_vocab_bucket: bool  # tied embedding under PP: megatron gives it its own DDP bucket
    tied_single: bool  # tied embedding with PP = 1: one tensor both looks up and projects
    experts: int = 0  # elements of MoE expert weights (the optimizer shards them over dp / ep)


def layer_params(dims: ModelDims, tp: int, ep: int = 1) -> tuple[int, int, int]:
    """(TP-split elements per rank, replicated elements, largest tensor) of one layer."""
    h = dims.hidden_size
    f = dims.moe_ffn_hidden_size if dims.is_moe else dims.ffn_hidden_size
    q = dims.num_attention_heads * dims.head_dim
    kv = dims.num_kv_heads * dims.head_dim
    qkv = h * (q + 2 * kv)
    split = (qkv + (q + 2 * kv if dims.qkv_bias else 0) + q * h) // tp
    split += layer_expert_params(dims, tp, ep) if dims.is_moe else 3 * h * f // tp
    replicated = 2 * h  # input and post-attention RMSNorm weights
    replicated += 2 * dims.head_dim if dims.qk_layernorm else 0  # per-head q/k norms (Qwen3)
    replicated += dims.num_experts * h  # the MoE router
    largest = max(qkv, q * h, 2 * h * f, h * f) // tp
    return split, replicated, largest


def layer_expert_params(dims: ModelDims, tp: int, ep: int = 1) -> int:
    """Expert weights of one MoE layer on one rank: ``experts / ep`` experts, each split over
    expert TP (0 for a dense model)."""
    return dims.num_experts // ep * 3 * dims.hidden_size * dims.moe_ffn_hidden_size // tp


def stage_params(
    dims: ModelDims,
    tp: int,
    pp: int,
    stage: int,
    layers: int,
    role: str = "actor",
    ep: int = 1,
) -> StageParams:
    """Parameters of ``stage`` (0-based) of ``pp`` holding ``layers`` layers, per TP rank (and
    EP rank, for an MoE model)."""
    split, replicated, largest = layer_params(dims, tp, ep)
    total = layers * (split + replicated)
    vocab_shard = dims.vocab_size * dims.hidden_size // tp
    first, last = stage == 0, stage == pp - 1
    vocab = 0
    if first:
        vocab += vocab_shard
    if last:
        total += dims.hidden_size  # final norm
        if role == "critic":
            total += dims.hidden_size + 1
        elif not (dims.tie_word_embeddings and pp == 1):
            vocab += vocab_shard
    total += vocab
    return StageParams(
        layers=layers,
        total=total,
        largest=max(largest if layers else 0, vocab_shard if vocab else 0),
        vocab=vocab,
        shared_vocab_bucket=dims.tie_word_embeddings and pp > 1 and vocab > 0 and role != "critic",
        tied_single=dims.tie_word_embeddings and pp == 1 and role != "critic",
        experts=layers * layer_expert_params(dims, tp, ep),
    )


def flops_params(dims: ModelDims) -> int:
    """Parameters that take part in matmuls per token: every layer and the output projection
    (a tied embedding projects too; the embedding lookup itself is no matmul). An MoE layer
    counts its router and the ``topk`` experts a token goes to."""
    split, _, _ = layer_params(dims, 1)
    if dims.is_moe:  # only the top-k experts of each token, and the router
        split += (
            (dims.moe_topk - dims.num_experts) * 3 * dims.hidden_size * dims.moe_ffn_hidden_size
        )
        split += dims.num_experts * dims.hidden_size
    return dims.num_layers * split + dims.vocab_size * dims.hidden_size


def stage_tensor_numels(
    dims: ModelDims, tp: int, pp: int, stage: int, layers: int, ep: int = 1
) -> list[int]:
    """The elements of each parameter tensor one rank of ``stage`` holds (what separate
    storages of a model's parameters, or of per-parameter optimizer state, are made of): per
    layer the fused QKV (and its bias), the attention output, the fused gate/up and the down
    projection (each local expert's, for an MoE layer, and the router), the norms; the
    vocabulary tensors of the first and last stage."""
    h = dims.hidden_size
    q = dims.num_attention_heads * dims.head_dim
    kv = dims.num_kv_heads * dims.head_dim
    per_layer = [h * (q + 2 * kv) // tp, q * h // tp, h, h]
    if dims.qkv_bias:
        per_layer.append((q + 2 * kv) // tp)
    if dims.qk_layernorm:
        per_layer += [dims.head_dim, dims.head_dim]
    if dims.is_moe:
        f = dims.moe_ffn_hidden_size
        per_layer.append(dims.num_experts * h)
        per_layer += [2 * h * f // tp, h * f // tp] * (dims.num_experts // ep)
    else:
        f = dims.ffn_hidden_size
        per_layer += [2 * h * f // tp, h * f // tp]
    out = per_layer * layers
    vocab = dims.vocab_size * h // tp
    if stage == 0:
        out.append(vocab)
    if stage == pp - 1:
        out.append(h)
        if not (dims.tie_word_embeddings and pp == 1):
            out.append(vocab)
    return out
