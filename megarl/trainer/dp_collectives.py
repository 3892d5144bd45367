"""Collectives over the data-parallel group, for statistics of the whole step's samples (and the
token counts that weigh a step's loss, in every trainer: megarl.sft too).

Only the DP group takes part: the model-parallel replicas of a DP rank (TP, PP, CP, EP) hold the
same samples, so a sum over the whole world would count them once per replica. In asynchronous
training the trainers have a world of their own (:mod:`megarl.world_split`) and megatron's DP
group lies inside it, so the rollout ranks never take part.
"""

from __future__ import annotations

from typing import TypeVar

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
