"""vLLM's CPU shared-memory segments, which a killed job leaves behind in /dev/shm.

vLLM names them after the TP group (``...-cpushm_N``), not the job, so the next run on the
machine - the resume, an elastic restart - would fail to create them ("create shm in SHMManager
failed. errno: 17"). Launchers note the segments present before a job and remove the new ones
after a job that did not end cleanly.
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
