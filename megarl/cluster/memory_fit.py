"""The memory preflight (megarl/plan/preflight.py) for an elastic restart's layout on GPUs: every
phase of the run's own settings at that layout, against this machine's GPU and host memory."""

from __future__ import annotations

import os

from megarl.backends import this_machine
from megarl.cluster.layouts import FitCheck, at_layout
from megarl.config import RunConfig
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.plan.preflight import Hardware, preflight


def gpu_memory_check(dims: ModelDims, gpu_memory: int, host_memory: int | None = None) -> FitCheck:
    """``host_memory`` per node; None: this machine's RAM."""
    machine = this_machine()
    host = host_memory or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def fits(cfg: RunConfig, layout: ParallelLayout) -> str | None:
        world = layout.world_size
        per_node = min(world, machine.local_gpus or world)
        if world % per_node:
            per_node = world
        hardware = Hardware(
            gpus_per_node=per_node,
            nnodes=world // per_node,
            gpu_memory=gpu_memory,
            host_memory=host,
        )
        pf = preflight(at_layout(cfg, layout), dims, hardware, machine, suggest=False)
        if pf.fits:
            return None
        return f"{layout}: " + "; ".join(p.message for p in pf.problems)

    return fits
