"""Reshard traffic of a layout for ``megarl plan``: the bytes each rank receives when the actor's
weights move into the rollout engine every step, from the pure reshard planner
(:func:`megarl.weights.reshard_schedule.reshard_traffic`) over the model's real tensor list.

The mode is the one a run of this layout would use with vLLM (``rollout.engine.reshard_mode=auto``):
``shard`` for dense models, ``full`` for mixture-of-experts ones. Figures are the most any rank
of the layout moves, in bytes of bf16 weights.
"""

from __future__ import annotations

from functools import lru_cache

from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.weights.reshard_mode import resolve_reshard_mode
from megarl.weights.reshard_schedule import PlannedTensor, RankTraffic, reshard_traffic
from megarl.weights.tensor_list import actor_planned_tensors

ROLLOUT_WEIGHT_BYTES = 2  # bf16


@lru_cache(maxsize=64)
def _specs(dims: ModelDims, layers_per_stage: tuple[int, ...], ep: int) -> list[PlannedTensor]:
    return actor_planned_tensors(dims, layers_per_stage, ROLLOUT_WEIGHT_BYTES, ep=ep)


def _traffic(
    dims: ModelDims, layout: ParallelLayout, mode: str, ranks_per_node: int
) -> list[RankTraffic]:
    specs = _specs(dims, tuple(layout.layers_per_stage(dims.num_layers)), layout.ep)
    return reshard_traffic(
        specs,
        layout.tp,
        layout.pp,
        layout.dp,
        layout.rollout_tp,
        mode=mode,
        ep=layout.ep,
        ranks_per_node=ranks_per_node,
    )


@lru_cache(maxsize=256)
def reshard_figures(
    dims: ModelDims, layout: ParallelLayout, gpus_per_node: int
) -> dict[str, int | str]:
    """``recv_bytes_per_rank`` (what a rank receives), ``min_bytes_per_rank`` (what it needs and
    does not hold: the least any plan delivers), ``cross_node_bytes_per_rank`` (of what it
    receives, the part from other nodes), ``loaded_bytes_per_rank`` (what its rollout engine
    loads: its TP slice in shard mode, the whole model in full mode), and full mode's
    ``full_recv_bytes_per_rank`` beside them; each the most of any rank."""
    mode = resolve_reshard_mode("auto", "vllm", dims.is_moe)
    ranks_per_node = min(gpus_per_node, layout.world_size)
    traffic = _traffic(dims, layout, mode, ranks_per_node)
    full = traffic if mode == "full" else _traffic(dims, layout, "full", ranks_per_node)
    return {
        "mode": mode,
        "recv_bytes_per_rank": max(t.recv for t in traffic),
        "min_bytes_per_rank": max(t.minimum for t in traffic),
        "cross_node_bytes_per_rank": max(t.cross_node for t in traffic),
        "loaded_bytes_per_rank": max(t.need for t in traffic),
        "full_recv_bytes_per_rank": max(t.recv for t in full),
    }
