"""A one-process run's rank, started while ``megarl train`` still checks the run.

The launcher's checks (registries, inputs, output folder, resume point, memory) import torch and
take seconds; the rank's own start (an interpreter, torch, megatron-core, transformers) takes
longer still. Both are single-threaded, so on a local one-process job the launcher starts the
rank first (right after reading the config) and the two run side by side on two cores. The
rank imports its libraries and then waits, having read nothing of the run, for the launcher's
go: the final arguments and the variables only known at launch (the failure record's path, the
elastic attempt). A run the checks refuse kills the waiting rank before the refusal is printed,
so a refused run looks exactly as before; a rank whose environment would differ from what the
launch needs (a GPU found after all, a variable the checks set) is killed and a fresh one
started, so the program a rank runs never depends on whether it was parked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from megarl.process_exit import end_process
from megarl.rank_exit import ATTEMPT_ENV, FAILURE_FILE_ENV
from megarl.rank_process_env import LaunchIdentity, local_rank_env, single_rank_command

GO_FD_ENV = "MEGARL_GO_FD"  # the rank's end of the pipe its go arrives on
# Variables a rank reads only once its program runs, so they may arrive with the go.
LATE_ENV = (FAILURE_FILE_ENV, ATTEMPT_ENV)
# Device nodes of a GPU driver: where one exists the launcher cannot tell, without importing
# torch, which environment the rank needs (CUDA's threads and allocator), so it does not park.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def no_gpu_driver() -> bool:
    """Whether this machine certainly has no GPU a rank could use (no driver's device node)."""
    return not any(Path(node).exists() for node in GPU_DEVICE_NODES)


class ParkedRank:
    """A rank process of a CPU one-process launch, waiting for :meth:`release`."""

    def __init__(
        self, proc: subprocess.Popen, go_fd: int, module: str, env: dict[str, str]
    ) -> None:
        self.proc, self.go_fd, self.module, self.env = proc, go_fd, module, env
        self.identity = LaunchIdentity.new(env)  # the port and segments it was started with

    @classmethod
    def start(cls, module: str, verbose: bool, base: Mapping[str, str]) -> ParkedRank:
        """Start ``python -m module`` with a one-process CPU launch's environment, parked."""
        identity = LaunchIdentity.new(base)
        env = local_rank_env(base, 1, False, identity, verbose=verbose)
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen(
                single_rank_command(module, []),
                env={**env, GO_FD_ENV: str(read_fd)},
                pass_fds=(read_fd,),
                start_new_session=True,  # as megarl.launch starts a rank: signals come through it
            )
        finally:
            os.close(read_fd)
        return cls(proc, write_fd, module, env)

    def mismatch(self, module: str, env: Mapping[str, str]) -> list[str]:
        """What keeps this rank from running ``module`` in ``env``: the variables (other than
        :data:`LATE_ENV`) that differ from the ones it started with, or another program."""
        if module != self.module:
            return [f"module {module}"]
        keys = (set(env) | set(self.env)) - set(LATE_ENV)
        return sorted(k for k in keys if env.get(k) != self.env.get(k))

    def release(self, args: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
        """Let the rank run with ``args``; ``env``'s :data:`LATE_ENV` variables are set first."""
        late = {k: env.get(k) for k in LATE_ENV}
        with os.fdopen(self.go_fd, "w") as go:
            go.write(json.dumps({"args": list(args), "env": late}) + "\n")
        return self.proc

    def discard(self) -> None:
        """Kill the rank (it has read nothing of the run, written nothing) and reap it."""
        with suppress(OSError):
            os.close(self.go_fd)
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class ParkedSlot:
    """The parked rank of one ``megarl train`` until a launch takes it (at most once)."""

    def __init__(self, rank: ParkedRank | None) -> None:
        self.rank = rank

    def take(self) -> ParkedRank | None:
        rank, self.rank = self.rank, None
        return rank


@contextmanager
def parked_rank(wanted: bool, module: str, verbose: bool) -> Iterator[ParkedSlot]:
    """A slot holding a parked rank of ``module`` when ``wanted`` (and no GPU driver is here);
    a rank still in it when the block ends (the run was refused, or launched otherwise) is
    killed before the block's exception, if any, goes on."""
    slot = ParkedSlot(
        ParkedRank.start(module, verbose, os.environ) if wanted and no_gpu_driver() else None
    )
    try:
        yield slot
    finally:
        left = slot.take()
        if left is not None:
            left.discard()


def await_go() -> list[str]:
    """In a parked rank: wait for the launcher's go and return the program's arguments, with
    the late variables set. A launcher that closes the pipe instead (the run was refused, or it
    ended) ends this process quietly: nothing of the run was read."""
    fd = int(os.environ.pop(GO_FD_ENV))
    with os.fdopen(fd) as go:
        line = go.readline()
    if not line:
        end_process(0)
    message = json.loads(line)
    for key, value in message["env"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return list(message["args"])
