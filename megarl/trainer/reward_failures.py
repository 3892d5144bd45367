"""The collective side of ``reward.max_failed_fraction``: every rank counts its failed scores, one
all-reduce sums them, and when too many failed every rank raises the same error (the first
failing rank's description), so no rank waits for the others."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl import platform
from megarl.rewards.failures import Failures, failed_scores_error, too_many_failed


def non_finite_model_scores(scores: torch.Tensor, model_path: str | None) -> Failures:
    """A reward model's NaN/inf scores, counted as failures."""
    bad = int((~torch.isfinite(scores)).sum())
    first = None
    if bad:
        first = f"the reward model reward.model_path={model_path} scored {bad} samples NaN or inf"
    return Failures(bad, scores.numel(), first)


def stop_on_failed_scores(parts: list[Failures], max_fraction: float) -> None:
    """Raise RewardError on every rank when more than ``max_fraction`` of all ranks' samples
    failed to score; collective (call at the same point on every rank)."""
    if max_fraction >= 1.0:
        return
    total = max((p.total for p in parts), default=0)  # the parts score the same samples
    failed = min(sum(p.failed for p in parts), total)
    distributed = dist.is_available() and dist.is_initialized()  # else one process: its own
    counts = torch.tensor([failed, total], dtype=torch.float64, device=platform.collective_device())
    if distributed:
        dist.all_reduce(counts)
    failed_all, total_all = int(counts[0]), int(counts[1])
    if not too_many_failed(failed_all, total_all, max_fraction):
        return
    mine = next((p.first for p in parts if p.first is not None), None)
    everyone: list = [mine]
    if distributed:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    first = next((m for m in everyone if m is not None), "no description")
    raise failed_scores_error(failed_all, total_all, max_fraction, first)
