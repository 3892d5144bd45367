"""The environment and command line a local launch gives its rank processes.

Torch-free on purpose: ``megarl train`` computes a one-process run's rank environment before it
imports torch (megarl.parked_rank starts that rank while the launcher still checks the run), and
megarl.launch computes the same environment for every local launch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megarl.console import rank_env
from megarl.host_allocator import cpu_allocator_env
from megarl.parent_death import children_env
from megarl.ports import free_port
from megarl.shm_segments import RUN_SEGMENTS_ENV, new_segment_prefix

LOOPBACK_IFNAMES = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
LAUNCHER_PID_ENV = "MEGARL_LAUNCHER_PID"  # the ranks learn that the launcher forwards signals


def launch_env(
    base: Mapping[str, str],
    nproc: int,
    cuda: bool,
    threads_per_rank: int | None = None,
    verbose: bool = False,
    env_extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The ranks' environment: ``base`` with the console's variables, ``env_extra``, and, where
    ``base`` does not set them, the threads per rank, (CPU ranks) the allocator's settings
    (megarl.host_allocator) and gloo's and NCCL's sockets on loopback (one machine's job)."""
    env = dict(base, **rank_env(verbose), **(env_extra or {}))
    for key, value in LOOPBACK_IFNAMES.items():
        env.setdefault(key, value)
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // nproc) if not cuda else 4
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank))
    for key, value in cpu_allocator_env(cuda).items():
        env.setdefault(key, value)
    return env


def single_rank_env(port: str) -> dict[str, str]:
    """What torchrun tells its one rank of a one-process job (torch.distributed's env://
    rendezvous reads MASTER_ADDR/PORT, RANK and WORLD_SIZE; megarl reads the local ones)."""
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "ROLE_RANK": "0",
        "ROLE_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }


@dataclass(frozen=True)
class LaunchIdentity:
    """What one local launch chooses once for all its ranks: the rendezvous port and the prefix
    of its vLLM shared-memory segments (megarl.shm_segments)."""

    port: str
    segments: str

    @classmethod
    def new(cls, base: Mapping[str, str]) -> LaunchIdentity:
        """A port and prefix of the user's environment where it sets them, else fresh ones."""
        return cls(
            base.get("MASTER_PORT") or str(free_port()),
            base.get(RUN_SEGMENTS_ENV) or new_segment_prefix(),
        )


def local_rank_env(
    base: Mapping[str, str],
    nproc: int,
    cuda: bool,
    identity: LaunchIdentity,
    threads_per_rank: int | None = None,
    verbose: bool = False,
    env_extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The whole environment of a local launch's process (torchrun's, or the one rank's)."""
    env = launch_env(base, nproc, cuda, threads_per_rank, verbose, env_extra)
    if nproc == 1:
        env.update(single_rank_env(rendezvous_port(env, identity)))
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    # The rank (or torchrun's agent, and in turn its ranks) ends with this process, however this
    # one ends (megarl.parent_death): a killed launcher leaves no rank training on.
    env.update(children_env())
    # This job's vLLM shared-memory segments carry this prefix: removed when the job ends.
    env.setdefault(RUN_SEGMENTS_ENV, identity.segments)
    return env


def rendezvous_port(env: Mapping[str, str], identity: LaunchIdentity) -> str:
    """The port the ranks meet on: the one the environment names, else the launch's own."""
    return env.get("MASTER_PORT") or identity.port


def single_rank_command(module: str, args: Sequence[str]) -> list[str]:
    """The one rank of a one-process job runs directly: ``python -m module args``."""
    return [sys.executable, "-m", module, *args]
