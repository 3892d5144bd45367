"""Collectives over the data-parallel group, for statistics of the whole step's samples (and the
token counts that weigh a step's loss, in every trainer: megarl.sft too).

Only the DP group takes part: the model-parallel replicas of a DP rank (TP, PP, CP, EP) hold the
same samples, so a sum over the whole world would count them once per replica. In asynchronous
training the trainers have a world of their own (:mod:`megarl.world_split`) and megatron's DP
group lies inside it, so the rollout ranks never take part.
"""

from __future__ import annotations

from typing import TypeVar, cast

import torch
import torch.distributed as dist

from megarl import parallel, platform

T = TypeVar("T")


def dp_split() -> bool:
    """Whether the step's samples are split over several DP ranks (not in one process, where
    torch.distributed may not even be initialised)."""
    return dist.is_initialized() and parallel.dp_size() > 1


def dp_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the data-parallel ranks (a collective; ``t`` itself when DP is 1)."""
    if not dp_split():
        return t
    out = t.to(platform.collective_device(), copy=True)
    dist.all_reduce(out, group=parallel.dp_group())
    return out.to(t.device)


def dp_mean(value: float) -> float:
    """The mean of ``value`` over the data-parallel ranks (a collective; ``value`` itself when DP
    is 1): a value every DP rank holds one of (its KL, its trained tokens), each counting alike.
    """
    if not dp_split():
        return value
    total = dp_sum(torch.tensor([value], dtype=torch.float64, device=platform.collective_device()))
    return float(total.item()) / parallel.dp_size()


def dp_gather(value: T) -> list[T]:
    """Every DP rank's ``value`` (picklable), in DP rank order (a collective; ``[value]`` when DP
    is 1): for what a sum cannot combine, or when ranks hold different keys."""
    if not dp_split():
        return [value]
    group = parallel.dp_group()
    out: list[T] = [value] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def dp_exchange(outgoing: list[T]) -> list[T]:
    """Point-to-point over the data-parallel ranks: ``outgoing[d]`` (picklable) goes to DP rank
    ``d``; returns what each DP rank sent this one, in DP rank order (a collective; ``outgoing``
    itself when DP is 1). Each rank receives only its own values, so moving rows between ranks
    costs a rank what it sends and receives, not the whole batch as :func:`dp_gather` would."""
    if not dp_split():
        return list(outgoing)
    group = parallel.dp_group()
    size = dist.get_world_size(group)
    if len(outgoing) != size:
        raise ValueError(f"{len(outgoing)} values to exchange over {size} data-parallel ranks")
    me = dist.get_rank(group)
    received: list[T] = []
    for source in range(size):  # one scatter a source rank: its values, one to each rank
        slot: list[T | None] = [None]
        dist.scatter_object_list(
            slot,
            outgoing if source == me else None,
            src=dist.get_global_rank(group, source),
            group=group,
        )
        received.append(cast(T, slot[0]))
    return received
