"""Start a megarl entry point on N local processes with torchrun, or run it in place when already
launched (torchrun or Slurm ``srun`` set RANK/WORLD_SIZE)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megarl import platform
from megarl.console import rank_env
from megarl.errors import ConfigError


def under_launcher() -> bool:
    """Whether this process is already one rank of a job (torchrun, or one ``srun`` task per GPU)."""
    _adopt_slurm_env()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _adopt_slurm_env() -> None:
    """Map Slurm's variables to torch.distributed's when started by ``srun`` without torchrun.

    Only inside a job step (``SLURM_STEP_ID``: a task of ``srun``), not in the batch script or an
    ``salloc`` shell. Rendezvous needs ``MASTER_ADDR``/``MASTER_PORT`` exported by the job script
    (e.g. ``MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)``).
    """
    env = os.environ
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and "RANK" not in env:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise ConfigError(
                "started by srun without torchrun, but MASTER_ADDR/MASTER_PORT are not set: "
                'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) '
                "and MASTER_PORT=<free port> in the job script"
            )
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")


def _free_port() -> int:
    """A free local port, so that runs side by side on one machine do not collide."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    module: str,
    args: Sequence[str],
    nproc: int,
    threads_per_rank: int | None = None,
    verbose: bool = False,
) -> int:
    """Run ``python -m module args`` on ``nproc`` local ranks with torchrun (through
    megarl.quiet_torchrun), quiet unless ``verbose`` (megarl/console.py); returns the exit code
    of the rank that failed, or 0."""
    env = dict(os.environ, **rank_env(verbose))
    if threads_per_rank is None:
        threads_per_rank = (
            max(1, (os.cpu_count() or 1) // nproc) if not torch.cuda.is_available() else 4
        )
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank))
    cmd = [
        sys.executable,
        "-m",
        "megarl.quiet_torchrun",
        f"--nproc-per-node={nproc}",
        "--master-port",
        env.get("MASTER_PORT") or str(_free_port()),
        "-m",
        module,
        *args,
    ]
    return subprocess.call(cmd, env=env)


def init_distributed() -> tuple[int, int]:
    """Initialise the default process group from the launcher's environment; returns (rank, world)."""
    _adopt_slurm_env()
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(platform.distributed_backend())
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and not torch.cuda.is_available():
        torch.set_num_threads(int(threads))
    platform.adapt_megatron_for_cpu()
    return dist.get_rank(), dist.get_world_size()
