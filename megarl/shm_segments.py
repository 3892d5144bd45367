"""vLLM's CPU shared-memory segments (TP > 1), which a killed job leaves behind in /dev/shm.

vLLM names them after the TP group (``...-cpushm_N``), not the job, so the next run on the
machine - the resume, an elastic restart, another job beside it - would fail to create them
("create shm in SHMManager failed. errno: 17"). Each job prefixes the names with its own
identifier (:func:`name_cpu_shm_segments_per_run`, called by the rollout before vLLM starts):
megarl's launchers choose it (:data:`RUN_SEGMENTS_ENV`, the same for every rank) and remove the
job's segments when it ends, however it ends (a rank ends without vLLM's own clean-up, see
megarl.entry, and a killed one never runs it); only this job's, never another's beside it.
"""

from __future__ import annotations

import os
import uuid
from contextlib import suppress
from pathlib import Path

_SHM = Path("/dev/shm")
# The prefix of a job's segment names, set by the launcher in every rank's environment.
RUN_SEGMENTS_ENV = "MEGARL_SHM_PREFIX"


def new_segment_prefix() -> str:
    """A prefix no other job on this machine uses."""
    return f"megarl-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_run_segments(prefix: str) -> None:
    """Remove the segments whose names start with a job's prefix (a no-op for an empty one)."""
    if prefix and _SHM.is_dir():
        remove_leftover_segments({p.name for p in _SHM.glob(f"{prefix}*")})


def remove_leftover_segments(names: set[str]) -> None:
    for name in names:
        with suppress(OSError):
            (_SHM / name).unlink()


def name_cpu_shm_segments_per_run(ident: str) -> None:
    """Give this run's vLLM CPU shared-memory segments (TP > 1) names no other run uses.

    vLLM's CPU build names them ``{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm``, and its CPU worker
    sets VLLM_DIST_IDENT from the distributed init method, which under megarl's external launcher
    is ``env://`` on every run: two runs on one machine then open the same segments, and a run
    killed with SIGKILL leaves segments that make every later run's engine fail ("create shm in
    SHMManager failed. errno: 17"). The name is prefixed here with IDENT (the same on every rank
    of the run); '/' is dropped, as shm_open takes no '/' inside a name.
    """
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    vllm_name = getattr(shm.make_group_name, "vllm_name", shm.make_group_name)

    def make_group_name(communicator: cpu_communicator.CpuCommunicator) -> str:
        return f"{ident}-{vllm_name(communicator)}".replace("/", "")

    make_group_name.vllm_name = vllm_name  # type: ignore[attr-defined]
    shm.make_group_name = staticmethod(make_group_name)
