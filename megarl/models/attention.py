"""Core attention for megatron's local layer spec built on ``torch.nn.functional.scaled_dot_product_attention``.

megatron's own ``DotProductAttention`` materialises the [b*heads, s, s] score matrix, a causal mask
per layer and a separate softmax; on CPU torch's SDPA kernel does the same maths fused (and with
grouped-query attention natively), which makes a training step faster than eager transformers'
instead of slower. Same inputs and output layout as ``DotProductAttention``; causal only.

Packed sequences (``PackedSeqParams`` in the THD layout, see :mod:`megarl.models.packing`) come as
``[t, heads, d]`` with cumulative sequence lengths: each sequence of the pack attends causally to
itself only (a block-diagonal causal mask), computed as one causal SDPA per sequence so the cost
is ``sum(len_i^2)``, not ``t^2``.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megarl import parallel


class SDPACoreAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        tp = parallel.tp_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        kv_channels = config.kv_channels
        self.softmax_scale = softmax_scale or config.softmax_scale or 1.0 / math.sqrt(kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention takes no attention mask or bias (causal only)")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, b = query.shape[0], query.shape[1]
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=self.groups != self.heads,
        )
        # [b, heads, s, d] -> [s, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query, key, value, packed_seq_params) -> torch.Tensor:
        """``[t, heads * d]`` attention of a THD pack ``[t, heads, d]``, sequence by sequence."""
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences must be THD, got {packed_seq_params.qkv_format}")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        lengths = [end - start for start, end in itertools.pairwise(bounds)]
        # a shared-prompt pack (megarl.models.shared_prompts) masks some segments itself
        masks = getattr(packed_seq_params, "segment_masks", None) or [None] * len(lengths)
        pieces = []
        for q, k, v, mask in zip(
            query.split(lengths), key.split(lengths), value.split(lengths), masks, strict=True
        ):
            # [len, heads, d] -> [heads, len, d]
            context = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                dropout_p=self.dropout if self.training else 0.0,
                is_causal=mask is None,
                scale=self.softmax_scale,
                enable_gqa=self.groups != self.heads,
            )
            pieces.append(context.transpose(0, 1))
        return torch.cat(pieces).reshape(query.shape[0], -1)
