"""Helpers of tests/distributed/test_loopback_listeners.py: what a job listens on.

Run as a rank (``python -m tests.distributed.listener_workers rank REPORT`` under megarl's
torchrun): it starts as megarl's ranks do (megarl.launch.init_distributed) and writes, as JSON in
``REPORT.<rank>``, the TCP sockets of the job that listen (its own, and the rendezvous store on
MASTER_PORT) with their addresses, and whether it can be read by other processes of its user
(``prctl(PR_GET_DUMPABLE)``).

Run as ``... ray REPORT``: it starts the local Ray instance as ``megarl train --launcher ray``
does and writes the listening sockets of every process Ray started."""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import sys
from pathlib import Path

PR_GET_DUMPABLE = 3
LISTEN = "0A"


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv4Address(raw[::-1])
    else:  # four 32-bit words, each in host (little-endian) order
        ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return f"{ip}:{int(port, 16)}"


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool((mapped or ip).is_loopback)


def listening() -> dict[str, str]:
    """inode -> address of every listening TCP socket in this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN:
                out[fields[9]] = _address(fields[1])
    return out


def sockets_of(pid: int | str) -> set[str]:
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def rank(report: str) -> None:
    import torch.distributed as dist

    from megarl.launch import init_distributed

    me, _ = init_distributed()
    dist.barrier()
    mine = sockets_of("self")
    port = os.environ["MASTER_PORT"]
    found = [
        {"address": a, "what": "rank" if inode in mine else "store"}
        for inode, a in listening().items()
        if inode in mine or a.rsplit(":", 1)[1] == port
    ]
    libc = ctypes.CDLL(None, use_errno=True)
    dumpable = libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
    Path(f"{report}.{me}").write_text(json.dumps({"listening": found, "dumpable": dumpable}))
    dist.barrier()
    dist.destroy_process_group()


def ray(report: str) -> None:
    import psutil

    from megarl.cluster.ray_job import RayLauncher

    launcher = RayLauncher.connect(None, 1, 1, False)
    try:
        table = listening()
        found = []
        me = psutil.Process()
        for proc in [me, *me.children(recursive=True)]:
            for inode in sockets_of(proc.pid):
                if inode in table:
                    found.append({"address": table[inode], "what": proc.name()})
        Path(report).write_text(json.dumps({"listening": found}))
    finally:
        launcher.close()


if __name__ == "__main__":
    {"rank": rank, "ray": ray}[sys.argv[1]](sys.argv[2])
