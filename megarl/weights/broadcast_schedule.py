"""The weight broadcast of asynchronous training: which trainer sends which slice to the rollout
group, in buckets. Pure and deterministic, like the reshard planner it builds on.

The trainers hold the actor in megatron's TP x PP x DP layout (:class:`PlannedTensor` pieces, as in
:mod:`megarl.weights.reshard_schedule`); every rollout rank needs every tensor whole (vLLM cuts
its own TP shard from full Hugging Face tensors). Each piece goes out once, by one broadcast from
one of the trainers holding it to all rollout ranks; the holders take turns over the DP replicas
(spread by tensor), so the sending is shared among the trainers. Buckets group whole tensors
(a fused group travels together) up to ``bucket_bytes`` of what a rollout rank assembles.

Every trainer that sends anything is the root of one broadcast group (itself and the rollout
ranks: :meth:`BroadcastSchedule.sources`); both sides walk the ops in the same global order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megarl.weights.reshard_schedule import (
    PlannedTensor,
    ReshardSchedule,
    Slice,
    _buckets,
    _pieces,
    check_specs,
)


@dataclass(frozen=True)
class Broadcast:
    """Slice ``slice`` of a spec, from trainer rank ``src`` to every rollout rank."""

    slice: Slice
    src: int
    nbytes: int


@dataclass(frozen=True)
class BroadcastSchedule:
    tp: int
    pp: int
    dp: int
    ep: int
    bucket_bytes: int
    specs: tuple[PlannedTensor, ...]
    buckets: tuple[tuple[int, ...], ...]  # spec indices per bucket
    ops: tuple[tuple[Broadcast, ...], ...]  # per bucket, in the global order

    @property
    def trainers(self) -> int:
        return self.tp * self.pp * self.dp

    def sources(self) -> list[int]:
        """The trainer ranks that send (each roots one broadcast group), ascending."""
        return sorted({op.src for bucket in self.ops for op in bucket})

    def send_bytes(self, trainer: int) -> int:
        return sum(op.nbytes for bucket in self.ops for op in bucket if op.src == trainer)

    def recv_bytes(self) -> int:
        """What each rollout rank receives: the whole model, once."""
        return sum(op.nbytes for bucket in self.ops for op in bucket)

    def peak_bucket_bytes(self) -> int:
        """The largest bucket a rollout rank assembles at once."""
        return max((sum(self.specs[t].nbytes for t in b) for b in self.buckets), default=0)


def schedule_broadcast(
    specs: Sequence[PlannedTensor],
    tp: int,
    pp: int,
    dp: int,
    bucket_bytes: int,
    ep: int = 1,
) -> BroadcastSchedule:
    """Plan sending every spec from the trainers' layout to the rollout group (module doc)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if ep < 1 or dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}")
    specs = tuple(specs)
    check_specs(specs, tp, pp, 1, "full", ep)
    layout = ReshardSchedule(tp, pp, dp, 1, "full", bucket_bytes, specs, [], {}, ep)
    buckets = _buckets(specs, lambda i: specs[i].nbytes, bucket_bytes)
    ops = []
    for members in buckets:
        bucket = []
        for t in members:
            spec = specs[t]
            row = spec.row_bytes()
            for k, ((a, b), holders) in enumerate(_pieces(spec, layout).items()):
                src = holders[(t + k) % len(holders)]
                bucket.append(Broadcast(Slice(t, a, b), src, (b - a) * row))
        ops.append(tuple(bucket))
    return BroadcastSchedule(
        tp, pp, dp, ep, bucket_bytes, specs, tuple(tuple(b) for b in buckets), tuple(ops)
    )
