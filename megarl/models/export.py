"""Gather this pipeline stage's parameters over TP and yield them as Hugging Face tensors."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl import parallel
from megarl.models.dims import ModelDims, expert_offset, layer_offset
from megarl.models.heads import has_scalar_head
from megarl.models.hf_map import NameIndex, megatron_shards_to_hf
from megarl.models.loading import mapped_parameters, unwrap
from megarl.parallel import ParallelLayout


def gather_tp(tensor: torch.Tensor) -> list[torch.Tensor]:
    """All TP shards of a tensor, in TP-rank order (one all-gather over the TP group)."""
    return gather_group(tensor, parallel.tp_group())


def gather_group(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """The tensor of every rank of ``group``, in group-rank order (one all-gather)."""
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

    An MoE layer's experts are gathered over expert tensor parallelism, then over expert
    parallelism (one expert at a time: every rank of the EP group yields every expert).
    """

    pp_rank = parallel.pp_rank()
    index = NameIndex(dims, layer_offset(dims, layout, pp_rank), role=role)
    if dims.is_moe:
        yield from _iter_moe_stage(model, dims, layout, use_main_grad, role)
        return
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


def _iter_moe_stage(
    model, dims: ModelDims, layout: ParallelLayout, use_main_grad: bool, role: str
) -> Iterator[tuple[str, torch.Tensor]]:

    offset = layer_offset(dims, layout, parallel.pp_rank())
    ep = parallel.ep_size()
    # one name index per expert-parallel rank: the HF names of that rank's experts
    by_ep_rank = [
        NameIndex(dims, offset, role=role, expert_offset=expert_offset(dims, r, ep))
        for r in range(ep)
    ]
    for name, param in mapped_parameters(model):
        if name == "output_layer.weight" and dims.tie_word_embeddings and layout.pp > 1:
            continue
        tm, hf_names = by_ep_rank[0].lookup(name)
        value = (param.main_grad if use_main_grad else param).detach()
        if not tm.per_expert:
            shards = gather_tp(value) if tm.tp_dim is not None else [value]
            yield from megatron_shards_to_hf(tm, hf_names, shards, dims)
            continue
        # this expert's expert-TP shards, stacked; then the same expert index of every EP rank
        etp_shards = torch.stack(gather_group(value, parallel.etp_group()))
        for r, stacked in enumerate(gather_group(etp_shards, parallel.ep_group())):
            _, names = by_ep_rank[r].lookup(name)
            yield from megatron_shards_to_hf(tm, names, list(stacked.unbind(0)), dims)
