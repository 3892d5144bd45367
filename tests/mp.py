"""Run a function on N gloo ranks with torch.multiprocessing and surface the first failure.

A worker is a module-level function ``fn(rank, world_size, *args)``; whatever it returns on each
rank comes back as a list indexed by rank (it must be picklable: tensors are fine).

Workers are forked from a fork server that has imported torch, megatron-core and transformers
once per test process (:mod:`tests.mp_preload`; about 5 s of every worker's start on 2 cores,
paid once instead of per rank and per call). Each worker still starts with the caller's
environment and working directory as of the call. A test whose workers must start as fresh
interpreters (e.g. glibc reads its malloc variables only at process start) passes
``fresh=True`` and they are spawned.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.process_exit import end_process


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    queue: Any,
    environ: dict[str, str],
    cwd: str,
) -> None:
    # a forked worker starts with the fork server's environment: take the caller's
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
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
        # The rendezvous store is the caller's (see run_gloo): it holds the port already.
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        # vLLM's shutdown may already have destroyed the default group.
        if dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group()
    # The result is sent (the queue's feeder thread joined): end the worker as megarl's ranks
    # end, without the interpreter's teardown (megarl.process_exit; seconds per worker).
    queue.close()
    queue.join_thread()
    end_process(0)


def _context(fresh: bool) -> Any:
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.mp_preload"])  # read when the server starts (once)
    return ctx


def run_gloo(
    fn: Callable, world_size: int, *args: Any, timeout: float = 600, fresh: bool = False
) -> list[Any]:
    """Start ``world_size`` processes running ``fn(rank, world_size, *args)`` over gloo: forked
    from the preloaded fork server, or spawned as fresh interpreters with ``fresh``."""
    import queue as queue_mod
    import time

    ctx = _context(fresh)
    queue = ctx.Queue()
    # The caller holds the rendezvous store on a port the OS picked while it is bound: no other
    # process (another xdist worker's job, a vLLM engine) can take that port between a free-port
    # probe and a rank's bind, which made rank 0 fail with EADDRINUSE under load.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    environ, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, port, fn, args, queue, environ, cwd),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    # Drain the queue while workers run: a large result blocks its sender until it is read.
    while len(results) + len(errors) < world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = queue.get(timeout=0.5)
        except queue_mod.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) and not errors:
                time.sleep(1.0)  # let the failing rank's traceback arrive
                while not queue.empty():
                    rank, status, payload = queue.get()
                    (
                        results.__setitem__(rank, payload)
                        if status == "ok"
                        else errors.append(f"rank {rank}:\n{payload}")
                    )
                break
            continue
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"rank {rank}:\n{payload}")
    for p in procs:
        p.join(5 if errors or len(results) == world_size else 1)
        if p.is_alive():
            p.kill()
            p.join()
    del store  # the port is free again once every rank is gone
    if errors:
        raise AssertionError("distributed worker failed\n" + "\n".join(errors))
    if len(results) != world_size:
        raise AssertionError(
            f"only ranks {sorted(results)} finished (exit codes {[p.exitcode for p in procs]}, timeout {timeout}s)"
        )
    return [results[r] for r in range(world_size)]
