"""Run a function on N gloo ranks with torch.multiprocessing and surface the first failure.

A worker is a module-level function ``fn(rank, world_size, *args)``; whatever it returns on each
rank comes back as a list indexed by rank (it must be picklable: tensors are fine).
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> list[Any]:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)`` over gloo."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    results: dict[int, Any] = {}
    errors: list[str] = []
    while not queue.empty():
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"rank {rank}:\n{payload}")
    for p in procs:
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("distributed worker failed\n" + "\n".join(errors))
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if bad or len(results) != world_size:
        raise AssertionError(f"ranks {bad} exited abnormally (exit codes {[p.exitcode for p in procs]})")
    return [results[r] for r in range(world_size)]
