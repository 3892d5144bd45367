"""One rank of a Ray job: a Ray actor that runs ``python -m megarl.entry ...`` as a child process,
as torchrun's agent does, and answers the driver's calls.

The rank runs in a fresh interpreter of its own (main thread, its own signal handlers, its own
process group), exactly as under torchrun; the actor only starts it, keeps its output until the
driver collects it, passes on signals, and ends it (with the helpers it started) when asked.
If the actor itself dies, the kernel ends the rank with it (parent-death signal).

Ray is imported only to describe where the actor runs; :mod:`megarl.cluster.ray_job` makes the
class an actor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass

from megarl.parent_death import set_parent_death_signal
from megarl.ports import free_port
from megarl.shm_segments import RUN_SEGMENTS_ENV, remove_run_segments


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the actor (its parent) dies."""
    with suppress(OSError):
        set_parent_death_signal()


@dataclass(frozen=True)
class Poll:
    """What a rank printed since the last poll, and its exit code once it has ended."""

    stdout: bytes
    stderr: bytes
    exit_code: int | None
    ended_at: float | None


class RankAgent:
    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self._out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []
        self._ended_at: float | None = None
        self._segments = ""  # this job's vLLM segment prefix (megarl.shm_segments)

    def describe(self) -> dict:
        """Where this actor runs: node id, IP, the GPUs Ray gave it, its CPU count."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cpus": os.cpu_count() or 1,
        }

    def free_port(self) -> int:
        """A free TCP port on this node (rank 0's actor: the rendezvous port)."""
        return free_port("")

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str | None:
        """Start ``python argv`` (this node's Python, the one running the actor) in ``cwd``;
        None, or why it cannot start here (a folder missing on this node)."""
        if not os.path.isdir(cwd):
            return (
                f"the working directory {cwd} does not exist on node "
                f"{self.describe()['ip']}; run megarl from a folder every node sees at the same "
                "path (a shared filesystem)"
            )
        self._segments = env.get(RUN_SEGMENTS_ENV, "")
        self.child = subprocess.Popen(
            [sys.executable, *argv],
            env={**os.environ, **env},
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: stop() ends its helpers too
            preexec_fn=_die_with_parent,
        )
        for name, pipe in (("stdout", self.child.stdout), ("stderr", self.child.stderr)):
            reader = threading.Thread(target=self._read, args=(name, pipe), daemon=True)
            reader.start()
            self._readers.append(reader)
        threading.Thread(target=self._wait, daemon=True).start()
        return None

    def _read(self, name: str, pipe) -> None:
        fd = pipe.fileno()
        while chunk := os.read(fd, 65536):
            with self._lock:
                self._out[name].append(chunk)

    def _wait(self) -> None:
        assert self.child is not None
        self.child.wait()
        self._ended_at = time.time()

    def poll(self) -> Poll:
        """New output and, once the rank has ended and its output is all read, its exit code."""
        code = None
        if self.child is not None and self._ended_at is not None:
            for reader in self._readers:
                reader.join(timeout=5.0)
            code = self.child.returncode
        with self._lock:
            out, err = b"".join(self._out["stdout"]), b"".join(self._out["stderr"])
            self._out = {"stdout": [], "stderr": []}
        return Poll(out, err, code, self._ended_at if code is not None else None)

    def send_signal(self, signum: int) -> None:
        if self.child is not None and self.child.poll() is None:
            with suppress(ProcessLookupError):
                os.kill(self.child.pid, signum)

    def stop(self) -> Poll:
        """End the rank and the processes it started (its process group); its last output.
        The job's vLLM shared-memory segments are removed (megarl.shm_segments)."""
        if self.child is not None:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, signal.SIGKILL)
            self.child.wait()
            self._ended_at = self._ended_at or time.time()
            remove_run_segments(self._segments)
        return self.poll()
