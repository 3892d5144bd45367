"""``megarl train``'s launch, once the config and inputs are checked: pick the launcher, check
what it needs before any rank starts, and run the job under the elastic supervisor."""

from __future__ import annotations

import torch

from megarl.cluster.elastic import Supervisor
from megarl.cluster.job import Launcher
from megarl.cluster.layouts import FitCheck, check_min_world_size
from megarl.cluster.local import LocalLauncher
from megarl.cluster.memory_fit import gpu_memory_check
from megarl.cluster.ray_job import RayLauncher
from megarl.cluster.slurm import SlurmLauncher, allocation_nodes
from megarl.config import RunConfig
from megarl.errors import ConfigError
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.parked_rank import ParkedRank


def world_size(launcher: str, nnodes: int | None, nproc_per_node: int, address: str | None) -> int:
    """The job's rank count from the launcher options; refuses options the launcher lacks."""
    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node {nproc_per_node} must be >= 1")
    if nnodes is not None and nnodes < 1:
        raise ConfigError(f"--nnodes {nnodes} must be >= 1")
    if launcher != "ray" and address is not None:
        raise ConfigError("--address is an option of --launcher ray (a Ray cluster's head)")
    if launcher == "torchrun" and (nnodes or 1) > 1:
        raise ConfigError(
            "--nnodes: --launcher torchrun starts ranks on this machine only. For several nodes: "
            "--launcher ray on a Ray cluster (docs/ray.md), or --launcher slurm in a Slurm "
            "allocation (docs/slurm.md)"
        )
    if launcher == "slurm" and nnodes is None:
        nnodes = len(allocation_nodes())
    return (nnodes or 1) * nproc_per_node


def start_job(
    cfg: RunConfig,
    module_args: list[str],
    layout: ParallelLayout,
    launcher: str,
    address: str | None,
    nnodes: int | None,
    verbose: bool,
    extra_ranks: int = 0,
    parked: ParkedRank | None = None,
) -> int:
    """Run ``python -m megarl.entry module_args`` on ``layout.world_size`` ranks (and
    ``extra_ranks`` more: an asynchronous run's rollout group); its exit code. ``parked``: the
    one rank of a local one-process job, already started (megarl.parked_rank)."""
    dims = ModelDims.from_pretrained(cfg.model.path)
    fits = _memory_check(dims)
    check_min_world_size(cfg, dims, layout.world_size, fits)
    if nnodes is None:
        nnodes = world_size(launcher, None, 1, address)  # slurm: the allocation's nodes; else 1
    job = _launcher(launcher, address, nnodes, layout.world_size + extra_ranks, verbose, parked)
    try:
        return Supervisor(cfg, module_args, layout, job, fits, extra_ranks=extra_ranks).run()
    finally:
        job.close()


def _launcher(
    kind: str,
    address: str | None,
    nnodes: int,
    world: int,
    verbose: bool,
    parked: ParkedRank | None = None,
) -> Launcher:
    if kind == "ray":
        return RayLauncher.connect(address, nnodes, world // nnodes, verbose)
    if kind == "slurm":
        return SlurmLauncher(nnodes, world // nnodes, verbose)

    return LocalLauncher(world, verbose, parked)


def _memory_check(dims: ModelDims) -> FitCheck | None:
    """On CUDA, the planner's memory check of a restart's layout; none on a CPU."""

    if not torch.cuda.is_available():
        return None

    return gpu_memory_check(dims, torch.cuda.get_device_properties(0).total_memory)
