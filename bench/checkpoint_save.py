"""What checksumming costs a training checkpoint save of SmolLM2-135M (printed, not asserted).

    .venv/bin/python -m bench.checkpoint_save [--repeats 5] [--dir /tmp/x]
    .venv/bin/python -m bench.checkpoint_save --smoke     # a tiny model, seconds; nothing stored

One process (gloo world of 1) builds SmolLM2-135M as megarl trains it (megatron DDP + the
distributed optimizer, Adam's states filled), then saves full training checkpoints
(``megarl.run.checkpointing.save``: model + optimizer dist checkpoint, HF assets, trainer state,
atomic rename, retention) alternately with the manifests (every file's size and XXH3-64
checksum, what every save writes) and with the hashing and the manifest writes replaced by
no-ops. It prints the median seconds of each, the checkpoint's size, the overhead of the
manifests against the limit of 5%, and, since a save's time on a shared disk varies more than
that, the CPU time of the checksum itself over the checkpoint's bytes in memory (what hashing
the bytes as they are written costs) against the same limit; writes
bench/results/checkpoint_save.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.results_io import load_1min, write_results
from megarl.ports import free_port

ROOT = Path(__file__).resolve().parent.parent

LIMIT = 0.05  # the manifests may add at most 5% to a save


@contextmanager
def _unhashed_writes() -> Iterator[None]:
    yield


@contextmanager
def without_manifests():
    """The save with the checksums and the manifest files left out (the baseline): no hashing
    in the writer, no reading back, no manifest written."""
    import megarl.checkpoint.manifest as manifest
    import megarl.checkpoint.store as store

    checksum, write, hashed = manifest.checksum, manifest.write, store.hashed_writes
    manifest.checksum = lambda path: "0" * 16
    manifest.write = lambda folder, records: folder / manifest.MANIFEST_FILE
    store.hashed_writes = _unhashed_writes
    try:
        yield
    finally:
        manifest.checksum, manifest.write, store.hashed_writes = checksum, write, hashed


def hashing_seconds(folder: Path) -> tuple[float, int]:
    """CPU seconds of XXH3-64 over every byte of ``folder`` held in memory (what the writer's
    hashing adds), and the bytes."""
    import xxhash

    total, seconds = 0, 0.0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        t0 = time.perf_counter()
        xxhash.xxh3_64(data).hexdigest()
        seconds += time.perf_counter() - t0
        total += len(data)
    return seconds, total


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind, alternating")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a tmp dir)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, one save each; CI")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)

    from megarl.models.build import ModelOptions
    from megarl.models.distributed import OptimSettings
    from megarl.parallel import ParallelLayout, initialize_model_parallel
    from megarl.platform import adapt_megatron_for_cpu
    from megarl.run import checkpointing
    from megarl.run.trainable import build_trainable
    from megarl.tools.testing.assets import smollm2_dir, tiny_llama_dir

    adapt_megatron_for_cpu()
    model_dir = tiny_llama_dir() if args.smoke else smollm2_dir()
    repeats = 1 if args.smoke else args.repeats
    layout = ParallelLayout(tp=1, pp=1, dp=1)
    initialize_model_parallel(layout, seed=1)
    trainable, dims = build_trainable(
        model_dir, layout, "actor", ModelOptions(dtype=torch.float32), OptimSettings(lr=1e-5)
    )
    for opt in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer]):
        with torch.no_grad():
            opt._init_optimizer_states_with_dummy_values()  # Adam's states, as after a step

    @dataclass(frozen=True)
    class Roles:
        dims: object

        def trainables(self):
            return {"actor": trainable}

    work = Path(args.dir or tempfile.mkdtemp(prefix="megarl-bench-ckpt-"))
    root = work / "checkpoints"
    seconds: dict[str, list[float]] = {"with manifests": [], "without": []}
    loads: list[float] = []  # the 1-minute load before each pair
    step, size = 0, 0
    for _ in range(repeats + 1):  # the first pair warms up (page cache, the writer's set-up)
        loads.append(load_1min())
        for kind in seconds:
            step += 1
            t0 = time.perf_counter()
            if kind == "without":
                with without_manifests():
                    path = checkpointing.save(
                        root, step, Roles(dims), str(model_dir), {"step": step}, keep_last=1
                    )
            else:
                path = checkpointing.save(
                    root, step, Roles(dims), str(model_dir), {"step": step}, keep_last=1
                )
            seconds[kind].append(time.perf_counter() - t0)
            size = folder_bytes(path)
    warmup = {k: v[0] for k, v in seconds.items()}  # stored, not in the medians
    seconds = {k: v[1:] for k, v in seconds.items()}
    with_m, without = (statistics.median(seconds[k]) for k in ("with manifests", "without"))
    overhead = with_m / without - 1.0
    hash_s, hashed = hashing_seconds(path)
    gib = size / 2**30
    print(
        f"bench/checkpoint_save: {model_dir.name}, one process, training checkpoint {gib:.2f} GiB"
    )
    for kind, values in seconds.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"  save {kind:>14}: median {statistics.median(values):.2f} s ({shown})")
    verdict = "within" if overhead <= LIMIT else "OVER"
    print(f"  manifests add {overhead:+.1%} to a save, medians (limit {LIMIT:.0%}: {verdict})")
    share = hash_s / without
    print(
        f"  XXH3-64 over the checkpoint's {hashed / 2**30:.2f} GiB in memory: {hash_s:.2f} s "
        f"({hashed / max(hash_s, 1e-9) / 1e9:.1f} GB/s) = {share:.1%} of a save without manifests "
        f"(limit {LIMIT:.0%}: {'within' if share <= LIMIT else 'OVER'})"
    )
    write_results(
        "checkpoint_save",
        {
            "model": model_dir.name,
            "checkpoint_bytes": size,
            "save_s_with_manifests": seconds["with manifests"],
            "save_s_without": seconds["without"],
            "warmup_pair_s": warmup,
            "load_1min_per_pair": loads,  # the warm-up pair's first
            "median_with_s": with_m,
            "median_without_s": without,
            "overhead": overhead,
            "hash_cpu_s": hash_s,
            "hash_share_of_save": share,
            "limit": LIMIT,
        },
        smoke=args.smoke,
        peak_size=256 if args.smoke else None,
    )
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
