"""Gather this pipeline stage's parameters over TP and yield them as Hugging Face tensors."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl import parallel
from megarl.models.dims import ModelDims
from megarl.models.heads import has_scalar_head
from megarl.models.hf_map import NameIndex, megatron_shards_to_hf
from megarl.models.loading import mapped_parameters, unwrap
from megarl.parallel import ParallelLayout


def gather_tp(tensor: torch.Tensor) -> list[torch.Tensor]:
    """All TP shards of a tensor, in TP-rank order (one all-gather over the TP group)."""
    group = parallel.tp_group()
    size = dist.get_world_size(group)
    if size == 1:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


@torch.no_grad()
def iter_stage_hf_tensors(
    model,
    dims: ModelDims,
    layout: ParallelLayout,
    use_main_grad: bool = False,
    role: str = "actor",
) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) for every parameter of this rank's pipeline stage.

    With ``use_main_grad`` the megatron DDP gradient (``param.main_grad``) is exported instead of
    the weight, in the same HF layout (used by gradient parity tests). The tied output layer of the
    last stage is skipped when the first stage already exports ``model.embed_tokens.weight``.
    A critic's or reward model's scalar head is included (as ``score``) for those roles.
    """
    from megarl.models.dims import layer_offset

    pp_rank = parallel.pp_rank()
    index = NameIndex(dims, layer_offset(dims, layout, pp_rank), role=role)
    params = mapped_parameters(model)
    if has_scalar_head(role):
        params += [
            (n, p) for n, p in unwrap(model).named_parameters() if n.startswith("output_layer.")
        ]
    for name, param in params:
        if name == "output_layer.weight" and dims.tie_word_embeddings and layout.pp > 1:
            continue
        tm, hf_names = index.lookup(name)
        value = param.main_grad if use_main_grad else param
        shards = gather_tp(value.detach()) if tm.tp_dim is not None else [value.detach()]
        yield from megatron_shards_to_hf(tm, hf_names, shards, dims)
