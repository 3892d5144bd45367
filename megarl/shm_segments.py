"""vLLM's CPU shared-memory segments (TP > 1), which a killed job leaves behind in /dev/shm.

vLLM names them after the TP group (``...-cpushm_N``), not the job, so the next run on the
machine - the resume, an elastic restart, another job beside it - would fail to create them
("create shm in SHMManager failed. errno: 17"). Each run prefixes the names with its own
identifier (:func:`name_cpu_shm_segments_per_run`, called by the rollout before vLLM starts), and
launchers note the segments present before a job and remove the new ones after a job that did
not end cleanly.
"""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path

_SHM = Path("/dev/shm")


def vllm_shm_segments() -> set[str]:
    """vLLM's CPU shared-memory segments present now."""
    return {p.name for p in _SHM.glob("*cpushm*")} if _SHM.is_dir() else set()


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
