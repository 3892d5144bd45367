"""Parameters of LoRA adapters on every linear of a decoder layer (``actor.lora.target_modules=
all-linear``), per TP rank, as :mod:`megarl.models.lora` splits them."""

from __future__ import annotations

from megarl.models.dims import ModelDims


def lora_layer_params(dims: ModelDims, tp: int, rank: int) -> int:
    """Adapter elements of one layer on one TP rank at LoRA ``rank`` (0: none).

    Column-parallel projections (q, k, v, gate, up): A ``[rank, in]`` whole on every TP rank, B
    ``[out / tp, rank]``. Row-parallel ones (o, down): A ``[rank, in / tp]``, B ``[out, rank]``
    whole."""
    if rank == 0:
        return 0
    h, hd, ffn = dims.hidden_size, dims.head_dim, dims.ffn_hidden_size
    q, kv = dims.num_attention_heads * hd, dims.num_kv_heads * hd
    column = [(q, h), (kv, h), (kv, h), (ffn, h), (ffn, h)]  # (out, in)
    row = [(h, q), (h, ffn)]
    total = sum(rank * i + (o // tp) * rank for o, i in column)
    total += sum(rank * (i // tp) + o * rank for o, i in row)
    return total
