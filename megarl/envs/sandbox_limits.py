"""What a sandboxed program may use (:class:`SandboxLimits`) and what came of it
(:class:`SandboxResult`): the seam between the python tool and the sandbox that runs it."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SandboxLimits:
    """Per call. ``memory_bytes`` caps the program's address space: the whole sandbox's, since
    the program is its only process; ``work_bytes`` caps its working folder (in memory, counted
    apart from ``memory_bytes``); ``file_bytes`` caps any one file; ``output_bytes`` is what is
    kept of stdout and of stderr each (the rest is read and dropped, counted as cut)."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_bytes: int = 512 << 20
    output_bytes: int = 16 << 10
    file_bytes: int = 16 << 20
    open_files: int = 64
    work_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"SandboxLimits.{f.name} must be > 0, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None  # negative: killed by that signal
    status: str  # ok | error | timeout | cpu_limit | memory_limit | refused
    truncated: bool  # stdout or stderr was longer than the limit and was cut
    seconds: float  # from handing the program over to its sandbox being gone
    network_isolated: bool  # ran without a network (an operating-system boundary)
    boundary: str = "bwrap"  # what held it (megarl.envs.boundary.BOUNDARIES)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def describe(self, limits: SandboxLimits) -> str:
        """What went wrong, in words for the model (empty when it ran fine)."""
        return {
            "ok": "",
            "timeout": f"timed out after {limits.wall_s:g} s (killed)",
            "cpu_limit": f"exceeded the CPU time limit of {limits.cpu_s} s (killed)",
            "memory_limit": f"exceeded the memory limit of {limits.memory_bytes >> 20} MiB",
            "refused": "was ended: it made a system call the sandbox refuses (network access)",
            "error": f"exited with status {self.returncode}",
        }[self.status]
