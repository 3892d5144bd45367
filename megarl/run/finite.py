"""Whether an update's losses and gradients are finite on every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl import platform
from megarl.errors import MegarlError

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel


class NonFiniteError(MegarlError):
    """The loss or the gradients of an update were NaN or inf."""


def all_finite(ddp: DistributedDataParallel, outputs: list[dict[str, torch.Tensor]]) -> bool:
    """Whether every rank saw finite losses and gradients (one all-reduce over the world)."""
    bad = any(not torch.isfinite(v).all() for out in outputs for v in out.values())
    for buffer in getattr(ddp, "buffers", []):
        bad = bad or not bool(torch.isfinite(buffer.grad_data).all())
    flag = torch.tensor([1.0 if bad else 0.0], device=platform.collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0
