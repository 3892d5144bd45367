"""A job on one machine listens on that machine only.

torch's TCPStore listens on every interface whatever host it is given, and gloo and NCCL open
their sockets on the interface the host name resolves to. When the ranks are told to meet at a
loopback address (``MASTER_ADDR=127.0.0.1``: megarl's single-node launches), nothing needs to
reach them from elsewhere, so:

- :func:`loopback_store` is the rendezvous store for such a job: its server socket is bound to
  127.0.0.1 and handed to TCPStore (``master_listen_fd``); megarl's torchrun
  (megarl.quiet_torchrun) hosts its agent's store this way and rank 0 of a job started without
  torchrun's agent (a local Ray instance, a one-process conversion) its own;
- ``LOOPBACK_IFNAMES`` (megarl.rank_process_env) points gloo and NCCL at the loopback interface
  (a setting given in the environment wins).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import torch.distributed as dist

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # torchrun's agent hosts the store


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback."""
    if not host:
        return False
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_store(
    port: int, world_size: int | None, is_master: bool, timeout: timedelta, **kwargs: object
) -> dist.TCPStore:
    """A TCPStore at 127.0.0.1:``port`` whose server (``is_master``) listens on loopback only."""
    if not is_master:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout, **kwargs)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen(socket.SOMAXCONN)
    except OSError:
        server.close()
        raise
    return dist.TCPStore(
        "127.0.0.1",
        server.getsockname()[1],
        world_size,
        True,
        timeout,
        master_listen_fd=server.detach(),  # the store owns the socket from here
        **kwargs,
    )


def rank_store(rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore | None:
    """The store of a rank whose job meets on loopback without torchrun's agent store (rank 0
    hosts it, on loopback); None for every other job (torch's ``env://`` then does as usual)."""
    if not is_loopback(os.environ.get("MASTER_ADDR")) or os.environ.get(AGENT_STORE_ENV) == "True":
        return None
    port = int(os.environ["MASTER_PORT"])
    return loopback_store(port, world_size, rank == 0, timeout, wait_for_workers=False)
