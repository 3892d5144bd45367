"""A rank that stops because another rank of its job ended: one line instead of a traceback.

When one rank dies (killed, out of memory, a user error), every other rank fails in its next
collective with the communication library's error (gloo: "Connection closed by peer"; NCCL: an
aborted communicator), tens of lines of traceback that say nothing about the cause and scroll
the failing rank's own message away. Such a rank says in one line that it lost its peers, and
the launcher's report names the rank that failed first.
"""

from __future__ import annotations

import os

from megarl.rank_exit import PEER_LOST_EXIT

__all__ = ["PEER_LOST_EXIT", "peer_lost"]

# Text of the errors torch.distributed's backends raise in a rank whose peer is gone.
PEER_LOST_TEXTS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL is aborted",
)


def peer_lost(error: BaseException) -> str | None:
    """The one-line account of ``error`` when it is a collective's failure because another rank
    ended; None for any other error (it keeps its traceback)."""
    if not isinstance(error, RuntimeError):  # torch.distributed.DistError subclasses it
        return None
    text = str(error)
    if not any(marker in text for marker in PEER_LOST_TEXTS):
        return None
    first = (text.strip().splitlines() or [""])[0]
    rank = os.environ.get("RANK", "?")
    return (
        f"rank {rank} stopped: another rank of the job ended while this one was communicating "
        f"with it ({first[:200]}); the launcher names the rank that failed first"
    )
