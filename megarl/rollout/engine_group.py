"""The ranks of one rollout engine as a process group, and its first rank's results handed to the
others: how a multi-turn rollout runs each environment once per sample, on the engine's first
rank, while every rank of the engine sends the engine the same requests
(:mod:`megarl.rollout.multi_turn`). Written once for the colocated engine
(:mod:`megarl.rollout.engine`) and the asynchronous rollout group
(:mod:`megarl.trainer.rollout_group`)."""

from __future__ import annotations

from typing import TypeVar, cast

import torch.distributed as dist

T = TypeVar("T")


def engine_group(ranks: int, infer_tp: int, rank: int) -> dist.ProcessGroup | None:
    """This rank's engine's group: one group per engine of ``infer_tp`` consecutive ranks of
    ``ranks``, made by every rank together in engine order (``new_group`` is a collective of
    the whole world); None where each engine is one rank."""
    if infer_tp == 1:
        return None
    mine = None
    for first in range(0, ranks, infer_tp):
        group = dist.new_group(list(range(first, first + infer_tp)))
        if first <= rank < first + infer_tp:
            mine = group
    return mine


def share_from_first(value: T | None, group: dist.ProcessGroup | None) -> T:
    """The ``value`` of the first rank of ``group`` (None on the others) on every rank of it;
    without a group this rank is the first and keeps its ``value``."""
    if group is None:
        return cast(T, value)
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return cast(T, box[0])


__all__ = ["engine_group", "share_from_first"]
