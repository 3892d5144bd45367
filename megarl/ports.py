"""Listening ports chosen where outgoing connections never take them.

A launch picks its rendezvous port seconds before rank 0 listens on it (the rank imports its
libraries first). A port from the kernel's ephemeral range (``bind(port 0)``) is the same kind
that every outgoing connection on the machine is given: gloo opens one per pair of ranks, so on a
machine running several jobs one of them can take the port in that window, and the store fails
with ``EADDRINUSE`` (seen with tests running side by side). Ports below the ephemeral range are
only ever taken by a listener that asks for one, so :func:`free_port` draws from there (at random,
free when drawn) and falls back to the kernel's choice where that range is unusable.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768  # Linux's default lower bound
BAND = 12000  # how many ports below the ephemeral range are drawn from
LOWEST = 10000  # never below: well-known and registered services live there
TRIES = 64

# not the random module's global generator, which training code seeds: two launches seeded alike
# would draw the same ports
_draw = random.SystemRandom()


def ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def listening_band() -> range:
    """The ports :func:`free_port` draws from: just below the ephemeral range."""
    high = ephemeral_low()
    return range(max(LOWEST, high - BAND), high)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside the ephemeral range where possible."""
    band = listening_band()
    if len(band):
        for _ in range(TRIES):
            port = _draw.choice(band)
            if _bindable(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
