"""What the elastic supervisor asks of a launcher: start a job of N ranks, report how it ended
and where its failed rank ran, and say how many ranks it could start now."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from megarl.errors import MegarlError

# Exit codes after which a restart cannot help: success, a user error (the same config fails the
# same way), an interrupt (Ctrl-C: the user wants the job to stop).
FINAL_EXIT_CODES = (0, MegarlError.exit_code, 130)


@dataclass(frozen=True)
class JobRequest:
    """``python -m module *args`` on ``world`` ranks, with ``env`` added to their environment,
    on none of the ``avoid`` slots (where earlier attempts' ranks failed)."""

    module: str
    args: Sequence[str]
    world: int
    env: Mapping[str, str] = field(default_factory=dict)
    avoid: Sequence[Hashable] = ()


@dataclass(frozen=True)
class JobResult:
    """How a job ended: the launcher's exit code (0, or the first failed rank's, as a shell
    reports it), which rank failed first and how (for the restart message), and the slot it ran
    on (the launcher's own name for a device or a node's share; None when unknown)."""

    exit_code: int
    failed_rank: int | None = None
    how: str = ""
    slot: Hashable | None = None

    @property
    def restartable(self) -> bool:
        return self.exit_code not in FINAL_EXIT_CODES


class Launcher(Protocol):
    """One way of starting ranks (local torchrun, Ray, Slurm)."""

    name: str

    def run(self, spec: JobRequest) -> JobResult:
        """Start the job, stream its output, pass on the signals the caller gets; block until it
        ends (every rank stopped)."""
        ...

    def capacity(self, lost: Sequence[Hashable]) -> int:
        """How many ranks could start now, leaving out the ``lost`` slots."""
        ...

    def placeable(self, world: int, lost: Sequence[Hashable]) -> bool:
        """Whether a job of ``world`` ranks can be placed (within :meth:`capacity`; Slurm places
        whole nodes only)."""
        ...

    @property
    def can_grow(self) -> bool:
        """Whether lost resources may come back (worth waiting for before a smaller restart)."""
        ...

    @property
    def interrupted(self) -> bool:
        """Whether the caller was signalled (preemption, Ctrl-C) during the last job."""
        ...

    def close(self) -> None: ...
