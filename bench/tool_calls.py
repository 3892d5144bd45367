"""Python tool calls per second: what the sandbox costs a multi-turn rollout.

    .venv/bin/python -m bench.tool_calls                      # the stored figures
    .venv/bin/python -m bench.tool_calls --smoke              # seconds, writes *.smoke.json

Each call runs a small program (``print(sum(i * i for i in range(1000)))``) through the rollout's
tool pool (megarl.envs.ToolPool), as a ToolEnvironment runs a model's call: the tool's process is
started, the program runs, its output comes back and everything it started is gone. Measured at
1 call at a time (latency) and at ``--concurrency`` calls at a time (a turn of several
trajectories), after a warm-up. Each variant is a ``python_tool(...)`` setting:

- ``default``: ``python_tool()`` as a run gets it;
- ``cold``: ``ready=0``, every call starts its sandbox when it comes;
- ``ready``: ``ready=--ready``, calls take a sandbox started ahead of them (the pool refills
  while the program runs).

Writes bench/results/tool_calls<--suffix>.json. ``tool_calls_before.json`` holds the figures of
the sandbox megarl had before the operating-system boundary (a plain child process with an audit
hook), measured in the same session with that code on PYTHONPATH::

    git archive a6f0e4e megarl | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before .venv/bin/python -m bench.tool_calls --variants default \\
        --suffix _before --note "megarl/ of a6f0e4e"

Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from bench.results_io import load_1min, write_results
from megarl.envs import SandboxLimits, ToolCall, ToolPool, python_tool

PROGRAM = "print(sum(i * i for i in range(1000)))"
EXPECTED = f"{sum(i * i for i in range(1000))}\n"


def _variant(name: str, ready: int) -> dict[str, Any]:
    return {"default": {}, "cold": {"ready": 0}, "ready": {"ready": ready}}[name]


async def _calls(tools: dict, pool: ToolPool, n: int, concurrency: int) -> tuple[float, list]:
    slots = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one() -> None:
        async with slots:
            t0 = time.perf_counter()
            out = await pool.call(tools, ToolCall("python", {"code": PROGRAM}))
            latencies.append(time.perf_counter() - t0)
            if out.content != EXPECTED:
                raise RuntimeError(f"the tool answered {out.content!r}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return time.perf_counter() - t0, latencies


def measure(kwargs: dict[str, Any], calls: int, concurrency: int) -> dict[str, float]:
    limits = SandboxLimits(cpu_s=5, wall_s=60)
    tool = python_tool(limits, **kwargs)
    tools = {tool.name: tool}
    pool = ToolPool(max_concurrency=max(concurrency, 1), timeout_s=120)

    async def run() -> dict[str, float]:
        await _calls(tools, pool, 4, 1)  # warm-up: imports, page cache, a first pool fill
        out: dict[str, float] = {}
        for width in (1, concurrency):
            seconds, lat = await _calls(tools, pool, calls, width)
            lat.sort()
            out[f"c{width}_calls_per_s"] = round(calls / seconds, 2)
            out[f"c{width}_p50_ms"] = round(1000 * statistics.median(lat), 1)
            out[f"c{width}_p95_ms"] = round(1000 * lat[int(0.95 * (len(lat) - 1))], 1)
        return out

    try:
        return asyncio.run(run())
    finally:
        pool.close()
        close = getattr(tool, "close", None)
        if callable(close):
            close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=64, help="calls per measurement")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--ready", type=int, default=4, help="sandboxes started ahead (`ready`)")
    p.add_argument("--variants", default="default,cold,ready")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds per variant")
    p.add_argument("--suffix", default="", help="stored as bench/results/tool_calls<suffix>.json")
    p.add_argument("--note", default="", help="stored with the figures (e.g. which code ran)")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:  # seconds: a few calls of each variant, once
        args.calls, args.repeats = min(args.calls, 8), 1
    names = [v for v in args.variants.split(",") if v]
    rounds: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for _ in range(args.repeats):  # alternate, so a load change hits every variant alike
        for name in names:
            figures = measure(_variant(name, args.ready), args.calls, args.concurrency)
            figures["load_1min"] = round(load_1min(), 2)
            rounds[name].append(figures)
            print(name, figures, flush=True)
    summary = {
        name: {
            key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "load_1min"
        }
        for name, runs in rounds.items()
    }
    for name, figures in summary.items():
        print(f"median {name}: {figures}")
    write_results(
        f"tool_calls{args.suffix}",
        {
            "program": PROGRAM,
            "note": args.note,
            "calls": args.calls,
            "concurrency": args.concurrency,
            "ready": args.ready,
            "median": summary,
            "rounds": rounds,
        },
        smoke=args.smoke,
    )


if __name__ == "__main__":
    main()
