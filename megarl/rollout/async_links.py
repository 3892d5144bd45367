"""The links between the trainers and the rollout group of asynchronous training, made the same
way on both sides: the weight broadcast schedule, and the bridges in one fixed order (each bridge is
a rendezvous of its members, so every process must make them in the same order).

- ``control``: trainer rank 0 and every rollout rank (objects: start, push, stop);
- ``batches``: the rollout leader and every trainer (objects: generated batches);
- ``weights[src]``: trainer ``src`` and every rollout rank, one per source of the plan (tensors:
  NCCL on GPUs, gloo on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.weights.broadcast_schedule import BroadcastSchedule, schedule_broadcast
from megarl.weights.tensor_list import actor_planned_tensors
from megarl.world_split import Bridge, SplitWorld

BUCKET_BYTES = 256 << 20  # the colocated reshard's bucket size


def weight_schedule(
    dims: ModelDims, trainers: ParallelLayout, itemsize: int, bucket_bytes: int = BUCKET_BYTES
) -> BroadcastSchedule:
    """The broadcast of the actor from the trainers' layout to the rollout group."""
    specs = actor_planned_tensors(
        dims, trainers.layers_per_stage(dims.num_layers), itemsize, ep=trainers.ep
    )
    return schedule_broadcast(
        specs, trainers.tp, trainers.pp, trainers.dp, bucket_bytes, trainers.ep
    )


@dataclass(frozen=True)
class Links:
    control: Bridge | None
    batches: Bridge | None
    weights: dict[int, Bridge]  # source trainer -> its broadcast group (where this rank is in it)


def make_links(world: SplitWorld, plan: BroadcastSchedule, weight_backend: str) -> Links:
    split = world.split
    rollout = split.rollout_global_ranks
    control = world.bridge("control", [0, *rollout])
    batches = world.bridge("batches", [split.rollout_leader, *split.trainer_ranks])
    weights = {}
    for src in plan.sources():
        bridge = world.bridge(f"weights/{src}", [src, *rollout], weight_backend)
        if bridge is not None:
            weights[src] = bridge
    return Links(control, batches, weights)


__all__ = ["BUCKET_BYTES", "Links", "make_links", "weight_schedule"]
