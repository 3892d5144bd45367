"""One data-parallel rank's prompts: megarl's sharded reader against pandas reading everything.

A 1,000,000-row verl-schema prompt set in 8 parquet files, 4 data-parallel ranks. Each path
delivers rank `--rank`'s share as batches of Python rows (what the tokenizer is fed next):
- megarl: ShardReader, which reads only the rank's row groups and columns, a window at a time;
- pandas: every file read with pandas.read_parquet and concatenated, then the rank's contiguous
  quarter sliced out, shuffled and turned into records batch by batch (the read-all-then-slice
  pattern of loaders that shard after loading).
Each path runs in its own subprocess, so its peak RSS is its own; the fastest of --repeat runs
counts (the machine may be shared). Prints, asserts nothing.
Targets: >= 3x rows/s, and peak RSS below half of the pandas path's.

    python -m bench.data [--rows 1000000 --files 8 --dp 4 --rank 1 --dir /tmp/megarl-bench-data]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results_io import load_1min, write_results

REPO = Path(__file__).resolve().parents[1]
WORDS = [
    "apples",
    "baker",
    "bought",
    "cookies",
    "dozen",
    "each",
    "eggs",
    "farmer",
    "garden",
    "hours",
    "items",
    "jars",
    "kilos",
    "liters",
    "miles",
]


def make_dataset(folder: Path, rows: int, files: int, row_group_size: int) -> list[Path]:
    """verl-schema files with a unique ~200-character question per row (cached by size)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    stamp = folder / f"rows{rows}-files{files}-rg{row_group_size}.done"
    paths = [folder / f"train-{i:02d}.parquet" for i in range(files)]
    if stamp.exists():
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_file = [rows // files + (i < rows % files) for i in range(files)]
    start = 0
    for path, n in zip(paths, per_file, strict=True):
        picks = rng.integers(0, len(WORDS), size=(n, 24))
        numbers = rng.integers(2, 500, size=(n, 3))
        content = [
            f"Problem {start + i}: " + " ".join(WORDS[w] for w in picks[i]) + f" {a} {b} {c}? "
            'Give the final answer after "####".'
            for i, (a, b, c) in enumerate(numbers.tolist())
        ]
        messages = pa.StructArray.from_arrays(
            [pa.array(["user"] * n), pa.array(content)], names=["role", "content"]
        )
        prompt = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), messages)
        truth = pa.array([str(x) for x in numbers[:, 0].tolist()])
        table = pa.table(
            {
                "data_source": pa.array(["openai/gsm8k"] * n),
                "prompt": prompt,
                "ability": pa.array(["math"] * n),
                "reward_model": pa.StructArray.from_arrays(
                    [pa.array(["rule"] * n), truth], names=["style", "ground_truth"]
                ),
                "extra_info": pa.StructArray.from_arrays(
                    [pa.array(["train"] * n), pa.array(np.arange(start, start + n))],
                    names=["split", "index"],
                ),
            }
        )
        pq.write_table(table, path, row_group_size=row_group_size)
        start += n
    stamp.touch()
    return paths


def peak_rss_mib() -> float:
    """This process's peak RSS. VmHWM, not getrusage: ru_maxrss survives fork+exec on Linux, so a
    child would report its parent's peak (here, the data generation) as its own."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_megarl(paths: list[str], dp: int, rank: int, batch: int) -> dict[str, float]:
    from megarl.data.parquet_source import inspect_files, resolve_files
    from megarl.data.shard_reader import ShardReader

    start, cpu_start = time.perf_counter(), cpu_seconds()
    fs, files = resolve_files(paths)
    reader = ShardReader(fs, inspect_files(fs, files), dp_rank=rank, dp_size=dp, seed=0)
    rows = batches = 0
    current: list = []
    for _, row in reader.iter_rows(0):
        current.append(row)
        if len(current) == batch:
            rows, batches, current = rows + len(current), batches + 1, []
    rows += len(current)
    return {
        "rows": rows,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": cpu_seconds() - cpu_start,
        "peak_rss_mib": peak_rss_mib(),
    }


def run_pandas(paths: list[str], dp: int, rank: int, batch: int) -> dict[str, float]:
    import numpy as np
    import pandas as pd

    start, cpu_start = time.perf_counter(), cpu_seconds()
    df = pd.concat([pd.read_parquet(p) for p in paths], ignore_index=True)
    begin, end = rank * len(df) // dp, (rank + 1) * len(df) // dp
    share = df.iloc[begin:end]
    share = share.iloc[np.random.default_rng(0).permutation(len(share))]
    rows = 0
    for lo in range(0, len(share), batch):
        rows += len(share.iloc[lo : lo + batch].to_dict("records"))
    return {
        "rows": rows,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": cpu_seconds() - cpu_start,
        "peak_rss_mib": peak_rss_mib(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--row-group-size", type=int, default=16_384)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/megarl-bench-data"))
    parser.add_argument("--repeat", type=int, default=3, help="runs per path; the fastest counts")
    parser.add_argument("--worker", choices=["megarl", "pandas"], help=argparse.SUPPRESS)
    parser.add_argument("--paths", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds; CI")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.files, args.row_group_size, args.repeat = 20_000, 2, 2_048, 1
        args.dir = Path(tempfile.mkdtemp(prefix="megarl-bench-data-smoke-"))
    if args.worker:
        run = run_megarl if args.worker == "megarl" else run_pandas
        print(json.dumps(run(args.paths, args.dp, args.rank, args.batch)))
        return

    t = time.perf_counter()
    paths = [str(p) for p in make_dataset(args.dir, args.rows, args.files, args.row_group_size)]
    size = sum(os.path.getsize(p) for p in paths) / 2**20
    print(
        f"data: {args.rows:,} rows in {args.files} files, row groups of {args.row_group_size:,}, {size:.0f} MiB "
        f"({time.perf_counter() - t:.1f} s to prepare); rank {args.rank} of {args.dp}, batches of {args.batch}"
    )
    runs: dict[str, list[dict[str, float]]] = {"megarl": [], "pandas": []}
    for _ in range(args.repeat):  # alternate the paths, so a noisy neighbour hits both
        for worker in runs:
            cmd = [sys.executable, "-m", "bench.data", "--worker", worker, "--dp", str(args.dp)]
            cmd += ["--rank", str(args.rank), "--batch", str(args.batch), "--paths", *paths]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
            load = load_1min()
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            runs[worker].append(json.loads(out.stdout.strip().splitlines()[-1]))
            runs[worker][-1]["load_1min"] = load  # every run is stored, with its load
    best = {w: min(rs, key=lambda r: r["seconds"]) for w, rs in runs.items()}
    for worker, r in best.items():
        walls = ", ".join(f"{x['seconds']:.2f}" for x in runs[worker])
        print(
            f"{worker:>7}: {r['rows']:,} rows in {r['seconds']:.2f} s (runs: {walls}) = "
            f"{r['rows'] / r['seconds']:,.0f} rows/s; {r['cpu_seconds']:.2f} CPU s; "
            f"peak RSS {r['peak_rss_mib']:,.0f} MiB"
        )
    m, p = best["megarl"], best["pandas"]
    speedup = (m["rows"] / m["seconds"]) / (p["rows"] / p["seconds"])
    cpu = p["cpu_seconds"] / m["cpu_seconds"]
    rss = m["peak_rss_mib"] / p["peak_rss_mib"]
    print(
        f"speed-up {speedup:.2f}x wall, {cpu:.2f}x CPU (target >= 3x: {'met' if speedup >= 3 else 'NOT met'}); "
        f"peak RSS ratio {rss:.2f} (target < 0.5: {'met' if rss < 0.5 else 'NOT met'})"
    )
    write_results(
        "data",
        {
            "rows": args.rows,
            "files": args.files,
            "dp": args.dp,
            "rank": args.rank,
            "runs": runs,
            "speedup_rows_per_s": speedup,
            "cpu_ratio": cpu,
            "peak_rss_ratio": rss,
        },
        smoke=args.smoke,
        peak_size=256 if args.smoke else 2048,
    )


if __name__ == "__main__":
    main()
