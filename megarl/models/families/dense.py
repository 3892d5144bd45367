"""The tensor map of a dense decoder (RMSNorm, rope, grouped-query attention, SwiGLU MLP).

Qwen2, Llama and Qwen3 share it; they differ in q/k/v bias and q/k norm, which the dims carry.
A family with other HF names passes its own :class:`HFNames`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.models.families.base import Dims, TensorMap

# The critic's value head (megarl.models.value_head.ValueHead, replicated over TP) in Hugging Face
# token-classification naming (``*ForTokenClassification`` with ``num_labels=1``): its ``score``
# linear layer, with bias. The reward model's head in sequence-classification naming
# (``*ForSequenceClassification``, ``num_labels=1``): ``score`` without bias.
SCORE_WEIGHT = "score.weight"
SCORE_BIAS = "score.bias"


@dataclass(frozen=True)
class HFNames:
    """HF tensor names of a dense decoder; ``{layer}`` is the global layer index, ``{p}`` one of
    q, k, v (attention projections) and ``{ln}`` q or k (per-head norms)."""

    embed: str = "model.embed_tokens.weight"
    layer: str = "model.layers.{layer}."
    input_norm: str = "input_layernorm.weight"
    qkv_weight: str = "self_attn.{p}_proj.weight"
    qkv_bias: str = "self_attn.{p}_proj.bias"
    qk_norm: str = "self_attn.{ln}_norm.weight"
    o_proj: str = "self_attn.o_proj.weight"
    post_attn_norm: str = "post_attention_layernorm.weight"
    gate: str = "mlp.gate_proj.weight"
    up: str = "mlp.up_proj.weight"
    down: str = "mlp.down_proj.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"


HF_DEFAULT = HFNames()


def head_maps(dims: Dims, role: str) -> list[TensorMap]:
    """The scalar head of the critic (with bias) or the reward model (without)."""
    h = dims.hidden_size
    maps = [TensorMap("output_layer.weight", (SCORE_WEIGHT,), "copy", None, (1, h))]
    if role == "critic":
        maps.append(TensorMap("output_layer.bias", (SCORE_BIAS,), "copy", None, (1,)))
    return maps


def dense_tensor_maps(
    dims: Dims, role: str = "actor", names: HFNames = HF_DEFAULT
) -> list[TensorMap]:
    """Every parameter of a dense decoder, in HF order.

    Actor and reference: ``output_layer`` is the LM head, listed even when tied (its HF name is
    then the embedding's). Critic and reward model: the same trunk, and the scalar head ``score``.
    """
    n = names
    L = n.layer
    M = "decoder.layers.{layer}."
    h, hd, f, v = dims.hidden_size, dims.head_dim, dims.ffn_hidden_size, dims.vocab_size
    qkv_rows = (dims.num_attention_heads + 2 * dims.num_kv_heads) * hd
    maps = [
        TensorMap("embedding.word_embeddings.weight", (n.embed,), "copy", 0, (v, h)),
        TensorMap(M + "input_layernorm.weight", (L + n.input_norm,), "copy", None, (h,)),
        TensorMap(
            M + "self_attention.linear_qkv.weight",
            tuple(L + n.qkv_weight.format(p=p) for p in "qkv"),
            "qkv",
            0,
            (qkv_rows, h),
        ),
    ]
    if dims.qkv_bias:
        maps.append(
            TensorMap(
                M + "self_attention.linear_qkv.bias",
                tuple(L + n.qkv_bias.format(p=p) for p in "qkv"),
                "qkv",
                0,
                (qkv_rows,),
            )
        )
    if dims.qk_layernorm:
        # One weight of head_dim shared by every head: replicated over TP.
        maps += [
            TensorMap(
                M + f"self_attention.{ln}_layernorm.weight",
                (L + n.qk_norm.format(ln=ln),),
                "copy",
                None,
                (hd,),
            )
            for ln in "qk"
        ]
    maps += [
        TensorMap(
            M + "self_attention.linear_proj.weight",
            (L + n.o_proj,),
            "copy",
            1,
            (h, dims.num_attention_heads * hd),
        ),
        TensorMap(M + "pre_mlp_layernorm.weight", (L + n.post_attn_norm,), "copy", None, (h,)),
        TensorMap(M + "mlp.linear_fc1.weight", (L + n.gate, L + n.up), "gate_up", 0, (2 * f, h)),
        TensorMap(M + "mlp.linear_fc2.weight", (L + n.down,), "copy", 1, (h, f)),
        TensorMap("decoder.final_layernorm.weight", (n.final_norm,), "copy", None, (h,)),
    ]
    if role in ("critic", "reward"):
        return maps + head_maps(dims, role)
    head = n.embed if dims.tie_word_embeddings else n.lm_head
    maps.append(TensorMap("output_layer.weight", (head,), "copy", 0, (v, h)))
    return maps
