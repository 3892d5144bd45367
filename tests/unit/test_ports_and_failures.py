"""Launch plumbing that must hold on a busy machine: rendezvous ports that outgoing connections
cannot take, and the failed rank a launcher names when several end at once."""

from __future__ import annotations

import socket

import pytest

from megarl import ports
from megarl.rank_exit import PEER_LOST_EXIT, first_cause


def test_free_ports_are_drawn_below_the_ephemeral_range_and_are_free() -> None:
    low = ports.ephemeral_low()
    band = ports.listening_band()
    assert band.stop == low and len(band) > 1000
    drawn = {ports.free_port() for _ in range(20)}
    assert all(p in band for p in drawn), drawn
    assert len(drawn) > 1  # drawn at random, not one fixed port
    for port in drawn:  # each was free when drawn: a listener can take it
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen(1)
        # a band of one port, and that port taken: the kernel's choice instead
        monkeypatch.setattr(ports, "listening_band", lambda: range(taken, taken + 1))
        assert ports.free_port() != taken


def test_the_draw_ignores_the_seeded_global_generator() -> None:
    import random

    random.seed(0)
    a = ports.free_port()
    random.seed(0)
    b = [ports.free_port() for _ in range(5)]
    assert any(p != a for p in b)  # two launches seeded alike do not draw alike


def test_the_first_cause_is_not_a_rank_that_lost_its_peer() -> None:
    # rank 3 was SIGKILLed; ranks 0-2 stopped in their next collective, and the launcher saw
    # rank 0's exit before it noticed rank 3's (the order seen on a loaded machine)
    seen = {0: (PEER_LOST_EXIT, 10.0), 1: (PEER_LOST_EXIT, 10.2), 2: (PEER_LOST_EXIT, 10.1)}
    assert first_cause({**seen, 3: (-9, 10.5)}) == 3
    # two real failures: the earlier one; only lost peers: the earliest of them
    assert first_cause({1: (1, 5.0), 2: (2, 4.0), 0: (PEER_LOST_EXIT, 1.0)}) == 2
    assert first_cause(seen) == 0
    assert first_cause({4: (1, 3.0), 2: (1, 3.0)}) == 2  # a tie: the lower rank


def test_the_first_cause_is_not_a_rank_the_launcher_ended_with_sigterm() -> None:
    # a CI run: rank 3 SIGKILLed, ranks 0 and 2 lost their peer, and rank 1, still running, was
    # ended by torchrun with SIGTERM and stamped in the same whole second as rank 3
    seen = {0: (PEER_LOST_EXIT, 100.0), 1: (-15, 101.0), 2: (PEER_LOST_EXIT, 100.0)}
    assert first_cause({**seen, 3: (-9, 101.0)}) == 3
    # only SIGTERMs and lost peers: the SIGTERM (a rank ended from outside the job)
    assert first_cause(seen) == 1
    assert first_cause({2: (-15, 7.0), 1: (-15, 8.0)}) == 2
