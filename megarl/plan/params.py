"""How many parameters one rank holds: one pipeline stage of a model, its TP-split share.

Counts follow megatron's GPTModel as megarl builds it (fused QKV with optional bias, fused
gate/up, RMSNorm weights replicated over TP, vocabulary-parallel embedding and output layer). With
tied embeddings and PP > 1 the last stage holds its own copy of the output weight; with PP = 1
the model holds one. A critic's output is a value head (hidden + 1 values) instead.
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


def layer_params(dims: ModelDims, tp: int) -> tuple[int, int, int]:
    """(TP-split elements per rank, replicated elements, largest tensor) of one layer."""
    h, f = dims.hidden_size, dims.ffn_hidden_size
    q = dims.num_attention_heads * dims.head_dim
    kv = dims.num_kv_heads * dims.head_dim
    qkv = h * (q + 2 * kv)
    split = (qkv + (q + 2 * kv if dims.qkv_bias else 0) + q * h + 3 * h * f) // tp
    replicated = 2 * h  # input and post-attention RMSNorm weights
    replicated += 2 * dims.head_dim if dims.qk_layernorm else 0  # per-head q/k norms (Qwen3)
    largest = max(qkv, q * h, 2 * h * f, h * f) // tp
    return split, replicated, largest


def stage_params(
    dims: ModelDims,
    tp: int,
    pp: int,
    stage: int,
    layers: int,
    role: str = "actor",
) -> StageParams:
    """Parameters of ``stage`` (0-based) of ``pp`` holding ``layers`` layers, per TP rank."""
    split, replicated, largest = layer_params(dims, tp)
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
    )


def flops_params(dims: ModelDims) -> int:
    """Parameters that take part in matmuls per token: every layer and the output projection
    (a tied embedding projects too; the embedding lookup itself is no matmul)."""
    split, _, _ = layer_params(dims, 1)
    return dims.num_layers * split + dims.vocab_size * dims.hidden_size
