"""The distributed optimizer's state for a checkpoint, written without gathering it.

megarl saves optimizer state in megatron's ``fully_reshardable`` form: for every parameter of a
tensor-parallel shard, global (model-space) tensors ``optimizer.state.{param,exp_avg,exp_avg_sq}``
shaped like the parameter, so a checkpoint loads at any TP x PP x DP layout. megatron builds them
for a save by all-gathering the shard's whole optimizer state onto every data-parallel rank first
(its memory-efficient option gathers onto DP rank 0 instead): host memory of one full TP shard's
state per rank, ~46 GB for Qwen2.5-7B at TP2, whatever the DP size.

Here each data-parallel rank writes only what it owns. Its distributed-optimizer shard of a
parameter is a flat range of the parameter's local (TP) tensor; a flat range of a row-major tensor
is a few rectangular blocks (:func:`flat_range_blocks`), and each block is a piece of the global
tensor that dist checkpointing stores as is (uneven pieces, checked by torch's DCP). The keys,
global shapes and common state are those of ``fully_reshardable``, so loading is megatron's own
``fully_reshardable`` load (any layout), and checkpoints saved either way load alike. Host memory
of a save: at most this rank's own shard (none on CPU, where the blocks are views).
"""

from __future__ import annotations

import math
from collections import ChainMap
from dataclasses import dataclass

import torch

FORM = "fully_reshardable"
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")

Block = tuple[tuple[int, ...], tuple[int, ...], int]  # (offset, shape, flat start)


def flat_range_blocks(shape: tuple[int, ...], lo: int, hi: int) -> list[Block]:
    """The flat range ``[lo, hi)`` of a row-major tensor of ``shape`` as rectangular blocks, in
    flat order: (offset, block shape, flat index of the block's first element)."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), lo)]
    inner = math.prod(shape[1:])
    out: list[Block] = []
    row = lo // inner
    if lo % inner:  # a partial first row
        end = min(hi, (row + 1) * inner)
        base = row * inner
        for off, shp, start in flat_range_blocks(shape[1:], lo - base, end - base):
            out.append(((row, *off), (1, *shp), base + start))
        row += 1
        if end == hi:
            return out
    full_end = hi // inner
    if full_end > row:  # whole rows
        out.append(((row,) + (0,) * (len(shape) - 1), (full_end - row, *shape[1:]), row * inner))
    if hi % inner:  # a partial last row
        base = full_end * inner
        for off, shp, start in flat_range_blocks(shape[1:], 0, hi - base):
            out.append(((full_end, *off), (1, *shp), base + start))
    return out


@dataclass(frozen=True)
class _Piece:
    """A part of a parameter's local tensor that is one contiguous chunk of a global tensor:
    its flat range in the local tensor and where it sits globally."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    prepend_axis_num: int
    replica_id: int | tuple[int, ...]  # megatron's ReplicaId
    start: int  # first flat index in the parameter's local tensor
    shape: tuple[int, ...]


def _pieces(meta) -> list[_Piece]:
    """The pieces of a parameter's model ShardedTensor; a ShardedTensorFactory (e.g. a fused
    gate/up projection stored as two global chunks) is built over the local flat indices to
    learn where each of its chunks comes from."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if not isinstance(meta, ShardedTensorFactory):
        return [
            _Piece(
                meta.key,
                tuple(meta.global_shape),
                tuple(meta.global_offset),
                meta.prepend_axis_num,
                meta.replica_id,
                0,
                tuple(meta.local_shape),
            )
        ]
    local = meta.data
    # flat indices, on the host: they only locate the chunks (the data stays where it is)
    index = torch.arange(local.numel(), dtype=torch.long, device="cpu").view(local.shape)
    out = []
    for sh in nested_values(meta.build_fn(meta.key, index, meta.replica_id, None)):
        flat = sh.data.reshape(-1)
        start = int(flat[0]) if flat.numel() else 0
        if not torch.equal(flat, torch.arange(start, start + flat.numel(), device="cpu")):
            raise NotImplementedError(
                f"{meta.key}: a factory chunk that is not contiguous in the local tensor"
            )
        out.append(
            _Piece(
                sh.key,
                tuple(sh.global_shape),
                tuple(sh.global_offset),
                sh.prepend_axis_num,
                sh.replica_id,
                start,
                tuple(sh.local_shape),
            )
        )
    return out


def _owned_blocks(piece: _Piece, lo: int, hi: int, flat: torch.Tensor, key: str) -> list:
    """ShardedTensors of the part ``[lo, hi)`` (local flat indices; ``flat`` holds them from
    ``lo``) that ``piece`` covers; the data-parallel replica coordinate is 0: every DP rank writes
    its own, disjoint blocks."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    a, b = max(lo, piece.start), min(hi, piece.start + math.prod(piece.shape))
    replica = piece.replica_id
    if isinstance(replica, tuple):
        replica = (*replica[:-1], 0)
    p = piece.prepend_axis_num
    out = []
    for off, shape, first in flat_range_blocks(piece.shape, a - piece.start, b - piece.start):
        begin = piece.start + first - lo
        # prepended axes (e.g. the layer of a stacked layer weight) become size-1 axes of the
        # block itself: uneven pieces are written as plain chunks of the global tensor
        block = (1,) * p + shape
        data = flat[begin : begin + math.prod(shape)].view(block)
        offset = tuple(piece.global_offset[:p]) + tuple(
            g + o for g, o in zip(piece.global_offset[p:], off, strict=True)
        )
        out.append(
            ShardedTensor(
                key=f"optimizer.state.{key}.{piece.key}",
                data=data,
                dtype=data.dtype,
                local_shape=block,
                global_shape=piece.global_shape,
                global_offset=offset,
                axis_fragmentations=None,
                replica_id=replica,
            )
        )
    return out


def _distributed_optimizer_state(opt, model_sd) -> dict[str, object]:
    """One DistributedOptimizer's sharded state dict, as its ``fully_reshardable`` save would
    make it, with this rank's blocks only."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sd)
    meta_of = {sh.data: sh for sh in nested_values(tensors)}
    param_state: dict[int, dict[str, list]] = {}
    param_idx = 0
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        buffer = opt.buffers[gbuf_idx]
        for buckets in gbuf_range_maps.values():
            owned = ChainMap(*(bucket["param_map"] for bucket in buckets))
            # the order of megatron's fully_reshardable form (its load matches entries by it)
            for model_param in buffer.param_index_map:
                if model_param in owned:
                    rng = owned[model_param]["param"]
                    states = opt._get_main_param_and_optimizer_states(model_param)
                    pieces = _pieces(meta_of[model_param])
                    entry: dict[str, list] = {}
                    for key in STATE_KEYS:
                        flat = states[key].detach().float().reshape(-1)
                        blocks = [
                            block
                            for piece in pieces
                            for block in _owned_blocks(piece, rng.start, rng.end, flat, key)
                        ]
                        if blocks:
                            entry[key] = blocks
                    # nothing empty stays behind: rank 0's leftovers become the common state,
                    # which a load merges with the tensors it reads at these same places
                    if entry:
                        param_state[param_idx] = entry
                param_idx += 1
    state = opt.state_dict()
    state["param_state"] = param_state
    state["param_state_sharding_type"] = FORM
    return state


def sharded_optimizer_state(
    optimizer, model_sd
) -> dict[str, object] | dict[int, dict[str, object]]:
    """The sharded state dict that ``optimizer.sharded_state_dict(model_sd, metadata=
    {"distrib_optim_sharding_type": "fully_reshardable"})`` saves, without its gather: for
    megatron's DistributedOptimizer, or a ChainedOptimizer of them (MoE: dense and expert
    parameters apart, prefixed ``chained_<i>.`` as megatron prefixes them)."""
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return _distributed_optimizer_state(optimizer, model_sd)
    if len(chained) == 1:
        return _distributed_optimizer_state(chained[0], model_sd)
    optimizer._synchronize_steps()
    out: dict[int, dict[str, object]] = {}
    for i, opt in enumerate(chained):
        state = _distributed_optimizer_state(opt, model_sd)
        add_prefix_for_sharding(state, f"chained_{i}.")
        out[i] = state
    return out
