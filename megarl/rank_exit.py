"""How a rank ended, as megarl's launchers report it: a shell's exit status for a rank killed by a
signal, the one line added after a failed rank's output, and the record of the first failed rank
that the elastic supervisor reads (``MEGARL_FAILURE_FILE``)."""

from __future__ import annotations

import signal
from collections.abc import Mapping

from megarl.errors import MegarlError

FAILURE_FILE_ENV = "MEGARL_FAILURE_FILE"
# the elastic supervisor's record of this attempt (megarl.run.elastic.AttemptRecord)
ATTEMPT_ENV = "MEGARL_ELASTIC"
# The exit code of a rank that stopped because another rank of its job ended (megarl.peer_loss):
# its own, so that a launcher can tell such a rank from the one that caused the failure.
PEER_LOST_EXIT = 3


def exit_code_of(rank_exit_code: int) -> int:
    """The launcher's exit code for a rank's: the same, or 128 + N for a rank killed by signal N
    (torchrun reports those as -N), as a shell would."""
    return 128 - rank_exit_code if rank_exit_code < 0 else rank_exit_code


def describe_exit(rank_exit_code: int) -> str:
    """How a rank ended, for a message: "was killed by SIGKILL", "exited with code 1"."""
    if rank_exit_code < 0:
        try:
            return f"was killed by {signal.Signals(-rank_exit_code).name}"
        except ValueError:
            return f"was killed by signal {-rank_exit_code}"
    return f"exited with code {rank_exit_code}"


def failure_note(rank: int, rank_exit_code: int) -> str | None:
    """The one line added after a failed rank's output, or None when the rank's own message
    (a megarl user error) must stay the last line."""
    if rank_exit_code == MegarlError.exit_code:
        return None
    how = describe_exit(rank_exit_code)
    return f"megarl: rank {rank} {how}; its output is above (--verbose shows torchrun's report)"


def _cause_order(exit_code: int) -> int:
    """0 for a failure of the rank's own, 1 for a SIGTERM (the signal a launcher ends the other
    ranks with once one has failed), 2 for a rank that stopped because it lost a peer."""
    if exit_code == PEER_LOST_EXIT:
        return 2
    return 1 if exit_code == -signal.SIGTERM else 0


def is_consequence(exit_code: int) -> bool:
    """Whether a rank's exit is another rank's doing (a SIGTERM, a lost peer), not a cause."""
    return _cause_order(exit_code) > 0


def first_cause(failures: Mapping[int, tuple[int, float]]) -> int:
    """The rank whose failure caused the job's: of ``failures`` (rank -> (exit code, time of
    failure)), the earliest of its own failures, else the earliest SIGTERM, else the earliest
    rank that stopped for a lost peer; a tie goes to the lower rank.

    A rank killed by a signal is seen by the launcher when it next polls, while the ranks it left
    in a collective record their own (later) exit at once: under load the launcher can see theirs
    first, so time alone would blame a rank that only lost its peer. torchrun then ends the ranks
    still running with SIGTERM and reports them as failed too, stamped to the whole second, so a
    SIGTERM can tie with the real cause: it only counts when no rank failed otherwise.
    """
    return min(failures, key=lambda r: (_cause_order(failures[r][0]), failures[r][1], r))
