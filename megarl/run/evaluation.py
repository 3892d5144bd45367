"""A forward-only pass of the supervised trainers over a whole dataset (validation): the loss
function's metrics summed over every micro-batch of every data-parallel rank, the same totals on
every rank."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megarl import parallel, platform
from megarl.models.forward import LossFn, broadcast_from_last_stage, run_schedule
from megarl.run.update import sum_outputs

T = TypeVar("T")


@torch.no_grad()
def dataset_totals(
    model: torch.nn.Module,
    batches: Iterable[list[T]],
    micro_batches: Callable[[list[T]], list[dict[str, Any]]],
    loss_fn: LossFn,
    keys: Sequence[str],
) -> dict[str, float]:
    """Sums of the loss function's metrics ``keys`` (each micro-batch's values weighted to sums,
    e.g. by its pair or token count) over all ``batches``, and ``items``: how many items they
    held; collective over PP and DP. A rank whose share ends a batch early (no rows) has nothing
    to add to it."""
    totals = torch.zeros(len(keys) + 1, dtype=torch.float64, device=platform.collective_device())
    for items in batches:
        if not items:
            continue
        sums = sum_outputs(run_schedule([model], micro_batches(items), loss_fn, forward_only=True))
        if sums:  # the last pipeline stage
            values = [sums[k] for k in keys] + [len(items)]
            totals += torch.tensor(values, dtype=torch.float64, device=totals.device)
    broadcast_from_last_stage(totals)
    dist.all_reduce(totals, group=parallel.dp_group())
    return dict(zip([*keys, "items"], totals.tolist(), strict=True))
