"""The local launcher: the ranks are torchrun's processes on this machine.

Its slots are the local devices (CUDA's, in ``CUDA_VISIBLE_DEVICES`` order) or, on a CPU,
numbered process places. A slot whose rank failed is left out of later attempts: on a GPU that
device is hidden from the restarted ranks.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Hashable, Sequence
from pathlib import Path

import torch

from megarl.cluster.job import JobRequest, JobResult
from megarl.launch import run_torchrun
from megarl.parked_rank import ParkedRank
from megarl.rank_exit import FAILURE_FILE_ENV, describe_exit


def local_devices() -> list[str] | None:
    """This machine's CUDA devices as ``CUDA_VISIBLE_DEVICES`` names them; None on a CPU."""
    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


class LocalLauncher:
    name = "local torchrun"
    can_grow = False  # a lost local device does not come back during the job

    def __init__(self, nproc: int, verbose: bool = False, parked: ParkedRank | None = None) -> None:
        self.verbose = verbose
        self.parked = parked  # the first attempt's one rank, already started
        self.devices = local_devices()
        places: list[Hashable] = list(self.devices) if self.devices else list(range(nproc))
        self.slots = places if len(places) >= nproc else list(range(nproc))
        self.interrupted = False

    def placeable(self, world: int, lost: Sequence[Hashable]) -> bool:
        return world <= self.capacity(lost)

    def capacity(self, lost: Sequence[Hashable]) -> int:
        return len([s for s in self.slots if s not in lost])

    def run(self, spec: JobRequest) -> JobResult:
        slots = self._slots_for(spec)
        env = dict(spec.env)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)
        self.interrupted = False
        with tempfile.TemporaryDirectory(prefix="megarl-job-") as tmp:
            failure = Path(tmp) / "failure.json"
            env[FAILURE_FILE_ENV] = str(failure)
            code = run_torchrun(
                spec.module,
                spec.args,
                spec.world,
                verbose=self.verbose,
                env_extra=env,
                on_signal=self._signalled,
                parked=self._take_parked(),
            )
            first = json.loads(failure.read_text()) if failure.is_file() else None
        if code == 0 or first is None:
            return JobResult(code)
        rank = int(first["rank"])
        return JobResult(code, rank, describe_exit(int(first["exit_code"])), slots[rank])

    def _take_parked(self) -> ParkedRank | None:
        parked, self.parked = self.parked, None
        return parked

    def _slots_for(self, spec: JobRequest) -> list[Hashable]:
        return [s for s in self.slots if s not in spec.avoid][: spec.world]

    def _signalled(self, signum: int) -> None:
        self.interrupted = True

    def close(self) -> None:
        parked = self._take_parked()
        if parked is not None:  # refused before its first attempt
            parked.discard()
