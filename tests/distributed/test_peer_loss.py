"""A rank whose peer is gone fails its next collective with gloo's own error, and megarl tells
that error from any other (megarl.peer_loss): one line, not a traceback."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megarl.peer_loss import peer_lost
from tests.mp import run_gloo


def _lose_a_peer(rank: int, world: int) -> tuple[str, str | None, str | None]:
    dist.barrier()
    if rank == 1:  # gone: its connections to rank 0 close
        dist.destroy_process_group()
        return "", None, None
    time.sleep(1.0)
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as e:
        return str(e), peer_lost(e), peer_lost(RuntimeError("shape mismatch in all_reduce"))
    return "no error", None, None


def test_a_collective_after_a_peer_ended_is_told_in_one_line():
    text, told, other = run_gloo(_lose_a_peer, 2)[0]
    assert told is not None, text
    assert told.startswith("rank 0 stopped: another rank of the job ended") and "\n" not in told
    assert "the launcher names the rank that failed first" in told
    assert other is None  # any other error keeps its traceback
