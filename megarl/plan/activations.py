"""Activation memory: what one micro-batch leaves stored for the backward pass.

Per transformer layer and token, the stored elements are counted by what they scale with::

    hidden * h / (tp if sequence parallel else 1)      norm inputs/outputs, residual stream
  + (query * q + kv * kv_dim + ffn * f) / tp           attention and MLP tensors (TP-split)
  + head_dim * d                                       rope cos/sin recomputed per layer (CPU)

times the activation dtype's bytes, plus, without flash attention, the score term of Korthikanti
et al. (2022), 5 * a * s^2 * b / tp bytes at 2-byte precision (softmax output, its dropout mask
and dropout output). For a GPT layer (q = kv = h, and a 4h GeLU MLP that stores its fc1 and GeLU
outputs, 8h, where SwiGLU stores 3f) plus two dropout masks, the GPU coefficients below give
Korthikanti's 34 * s * b * h bytes per layer; megarl runs with dropout 0, so the masks' 2 * s *
b * h bytes are left out.

Mixture of experts (megatron's all-to-all dispatcher, expert TP = TP, sequence parallel with TP >
1): a rank's ``T`` tokens entering a layer (``b * s / tp``) are routed ``k = topk`` times each. The
experts' fc1 input is stored for the backward: the routed tokens of every expert-TP rank, gathered,
``tp * T * k * h`` elements (:func:`moe_stored_bytes`). While the layer dispatches (forward, and
its backward the other way) a rank holds, beside it, the permuted copy of its routed tokens and the
all-to-all's output (``T * k * h`` each), the expert-TP all-gather's output and its copy sorted by
local expert (``tp * T * k * h`` each): :func:`moe_dispatch_bytes`. For Qwen3-30B-A3B at TP4 that
is about 4.5 times the dense items of its layer.

Full recomputation (megatron ``recompute_granularity=full``, uniform, 1 layer per checkpoint)
stores only each layer's input and re-runs one layer at a time in the backward pass, so the
stage holds ``layers * input + one layer's full activations``. Selective recomputation
(megatron's core-attention recompute, ``recompute_granularity=selective``) drops only the score
term, which flash attention never stores: with flash attention it equals no recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.models.dims import ModelDims


@dataclass(frozen=True)
class ActivationProfile:
    """Stored elements per token, as multiples of the model's sizes (see the module doc)."""

    name: str
    hidden: float  # x h, replicated over TP without sequence parallelism
    query: float  # x heads * head_dim, TP-split
    kv: float  # x kv_heads * head_dim, TP-split
    ffn: float  # x ffn size, TP-split
    head_dim: float  # x head_dim, not split
    stage_input: float  # x h once per stage: the embedding output / the received activation
    final_hidden: float  # x h on the last stage: final norm and output-layer inputs
    bytes: int  # bytes per stored element
    flash_attention: bool
    sequence_parallel: bool  # with TP > 1


# megatron-core on GPUs with Transformer Engine (bf16, flash attention, fused SwiGLU and RMSNorm,
# sequence parallelism with TP > 1): norm inputs 2h, QKV and fc1 inputs 2h; q, k, v and the
# attention output; fc1 output (gate and up, 2f) and fc2 input (f).
GPU_TE_BF16 = ActivationProfile(
    name="gpu-bf16 (Transformer Engine, flash attention, sequence parallel)",
    hidden=4,
    query=2,
    kv=2,
    ffn=3,
    head_dim=0,
    stage_input=0,
    final_hidden=2,
    bytes=2,
    flash_attention=True,
    sequence_parallel=True,
)

# megarl on CPU (megatron local layer spec, torch SDPA flash kernel, no fusions, fp32), counted
# from the tensors autograd saves and checked against measurement
# (tests/distributed/test_plan_memory.py): per norm the input, the normalised value and the
# weighted output (3h each, the input being the previous op's output); the fused QKV output
# (kept whole because V is a view of it), rotated q and k, the SDPA output; fc1 output (2f), the
# "up" half plus offset (f), SiLU output (f) and their product (f); rope cos/sin for q and k.
CPU_LOCAL_FP32 = ActivationProfile(
    name="cpu-fp32 (megatron local spec, torch SDPA)",
    hidden=6,
    query=3,
    kv=3,
    ffn=5,
    head_dim=4,
    stage_input=1,
    final_hidden=2,
    bytes=4,
    flash_attention=True,
    sequence_parallel=False,
)


def _ffn_per_token(dims: ModelDims) -> int:
    """FFN width a token's activations span: an MoE token goes through ``topk`` experts."""
    return dims.moe_topk * dims.moe_ffn_hidden_size if dims.is_moe else dims.ffn_hidden_size


def _per_token_elements(p: ActivationProfile, dims: ModelDims, tp: int) -> float:
    q = dims.num_attention_heads * dims.head_dim
    kv = dims.num_kv_heads * dims.head_dim
    hidden_div = tp if p.sequence_parallel else 1
    return (
        p.hidden * dims.hidden_size / hidden_div
        + (p.query * q + p.kv * kv + p.ffn * _ffn_per_token(dims)) / tp
        + p.head_dim * dims.head_dim
    )


def layer_bytes(
    p: ActivationProfile, dims: ModelDims, tp: int, batch: int, seq: int, scores: bool = True
) -> int:
    """Bytes one layer stores for one micro-batch without recomputation (``scores=False``: under
    selective recomputation, which recomputes the attention scores instead of storing them); an
    MoE layer's include its experts' gathered input (:func:`moe_stored_bytes`)."""
    stored = batch * seq * _per_token_elements(p, dims, tp) * p.bytes
    if scores and not p.flash_attention:
        stored += 5 * dims.num_attention_heads * seq * seq * batch / tp * (p.bytes / 2)
    return int(stored) + moe_stored_bytes(p, dims, tp, batch, seq)


def _routed_elements(p: ActivationProfile, dims: ModelDims, tp: int, batch: int, seq: int) -> float:
    """``T * k * h``: a rank's routed token copies entering one MoE layer (module doc)."""
    tokens = batch * seq / (tp if p.sequence_parallel else 1)
    return tokens * dims.moe_topk * dims.hidden_size


def moe_stored_bytes(p: ActivationProfile, dims: ModelDims, tp: int, batch: int, seq: int) -> int:
    """Bytes an MoE layer stores beyond the dense items for its backward: the experts' fc1
    input, gathered over expert TP (0 for a dense model)."""
    if not dims.is_moe:
        return 0
    return int(tp * _routed_elements(p, dims, tp, batch, seq) * p.bytes)


def moe_dispatch_bytes(p: ActivationProfile, dims: ModelDims, tp: int, batch: int, seq: int) -> int:
    """Transient bytes of one MoE layer's token dispatch (module doc; 0 for a dense model)."""
    if not dims.is_moe:
        return 0
    return int((2 + 2 * tp) * _routed_elements(p, dims, tp, batch, seq) * p.bytes)


def checkpoint_bytes(p: ActivationProfile, dims: ModelDims, tp: int, batch: int, seq: int) -> int:
    """Bytes one layer stores under full recomputation: its input only."""
    hidden_div = tp if p.sequence_parallel else 1
    return int(batch * seq * dims.hidden_size / hidden_div * p.bytes)


def hidden_bytes(p: ActivationProfile, dims: ModelDims, tp: int, batch: int, seq: int) -> int:
    """Bytes of one [seq, batch, hidden] activation as this profile stores it."""
    hidden_div = tp if p.sequence_parallel else 1
    return int(batch * seq * dims.hidden_size / hidden_div * p.bytes)
