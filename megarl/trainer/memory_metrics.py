"""This process's memory as step metrics (``memory/...``, GiB), so a leak shows on the curves."""

from __future__ import annotations

import resource
import sys

import psutil
import torch

from megarl.metrics import Reduce

GIB = float(1 << 30)

# The fullest rank is what runs out of memory: every memory metric is the maximum over ranks.
MEMORY_REDUCTIONS = {
    name: Reduce.MAX
    for name in (
        "memory/host_rss_gib",
        "memory/host_peak_rss_gib",
        "memory/gpu_allocated_gib",
        "memory/gpu_step_peak_allocated_gib",
    )
}


def memory_metrics() -> dict[str, float]:
    """Host resident memory now and at its peak; on CUDA also the allocator's current and peak
    allocation (the peak is reset, so each step reports its own)."""
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak_bytes = peak_rss if sys.platform == "darwin" else peak_rss * 1024
    out = {
        "memory/host_rss_gib": psutil.Process().memory_info().rss / GIB,
        "memory/host_peak_rss_gib": peak_bytes / GIB,
    }
    if torch.cuda.is_available():
        out["memory/gpu_allocated_gib"] = torch.cuda.memory_allocated() / GIB
        out["memory/gpu_step_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()
    return out
