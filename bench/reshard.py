"""Reshard traffic, transient memory and speed of the hybrid engine's executor, on 4 gloo ranks.

    .venv/bin/python bench/reshard.py                 # SmolLM2-135M and a 0.5B-shaped model
    .venv/bin/python bench/reshard.py --models smollm2 --bucket-mb 64

Per model and layout the planner's plan runs through the executor with a sink that drops each
bucket (vLLM's load time is not part of this figure), and we print, worst rank:

- bytes received / the planner's minimum (bytes the rank needs and does not hold), target 1.00;
- peak transient bytes / ``bucket_bytes`` (the executor's own accounting of what it allocates:
  bucket tensors, receive staging, the QKV split), target <= 1.0 + one tensor;
- seconds / a raw ``all_gather`` moving the same bytes per rank in bucket-sized pieces, target
  <= 1.3.

``full`` mode is what the CPU vLLM needs (whole HF tensors on every rank; independent of
infer_tp); ``shard`` mode is the zero-redundancy transition (each rank gets its inference shard,
megatron layout, no HF conversion) for engines that take pre-sharded tensors.
SmolLM2 (9 heads, 3 KV heads) allows no TP2: it trains at TP1xPP2xDP2 and infers at infer_tp 1
(its heads allow no infer_tp 2 either). The 0.5B model has Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
FFN 4864, vocab 151,936, tied) with zero weights (values do not change traffic or time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

QWEN05_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
}


def _raw_allgather_seconds(total_bytes: int, bucket_bytes: int, world: int) -> float:
    """all_gather moving ``total_bytes`` into every rank (each contributes 1/(world-1) of it)."""
    chunk = max(1, bucket_bytes // (world - 1) // 4)
    remaining = total_bytes // 4 // (world - 1)
    send = torch.zeros(chunk)
    outs = [torch.empty(chunk) for _ in range(world)]
    dist.barrier()
    t0 = time.perf_counter()
    while remaining > 0:
        n = min(chunk, remaining)
        dist.all_gather([o[:n] for o in outs], send[:n])
        remaining -= n
    dist.barrier()
    return time.perf_counter() - t0


def worker(rank: int, world: int, model_dir: str, cases: list[dict], bucket_bytes: int) -> list:
    from megarl.platform import adapt_megatron_for_cpu

    adapt_megatron_for_cpu()
    from megatron.core import parallel_state as ps

    from megarl.hybrid_engine.execute import ReshardExecutor, local_spec_tensors
    from megarl.hybrid_engine.reshard_plan import plan_reshard
    from megarl.hybrid_engine.tensor_list import actor_tensor_specs
    from megarl.models.build import build_model
    from megarl.models.dims import layer_offset
    from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel

    rows = []
    for case in cases:
        layout = ParallelLayout.for_world(world, tp=case["tp"], pp=case["pp"])
        initialize_model_parallel(layout)
        model, dims = build_model(model_dir, layout, load=case["load"])
        specs = actor_tensor_specs(dims, layout.layers_per_stage(dims.num_layers))
        offset = layer_offset(dims, layout, ps.get_pipeline_model_parallel_rank())
        local = local_spec_tensors(model, dims, offset, specs)
        for infer_tp, mode in case["infer"]:
            plan = plan_reshard(
                specs, layout.tp, layout.pp, layout.dp, infer_tp, bucket_bytes, mode=mode
            )
            ex = ReshardExecutor(plan, dims, rank)
            ex.run(local, lambda bucket: None, convert=mode == "full")  # warm-up
            dist.barrier()
            stats = ex.run(local, lambda bucket: None, convert=mode == "full")
            dist.barrier()
            largest = max(s.nbytes for s in specs)
            total = torch.tensor([float(plan.recv_bytes(r)) for r in range(world)]).max().item()
            raw = _raw_allgather_seconds(int(total), bucket_bytes, world)
            rows.append(
                dict(
                    model=case["name"],
                    layout=str(layout),
                    infer_tp=infer_tp,
                    mode=mode,
                    recv=stats.recv_bytes,
                    min_recv=plan.min_recv_bytes(rank),
                    peak=stats.peak_transient_bytes,
                    bucket=bucket_bytes,
                    largest=largest,
                    seconds=stats.seconds,
                    raw_seconds=raw,
                    buckets=stats.buckets,
                )
            )
        del local, model
        destroy_model_parallel()
    return rows


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the gloo spawn helper in tests/
    from results_io import write_results

    from megarl.testing.assets import smollm2_dir, tiny_qwen2_dir
    from tests.mp import run_gloo

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,qwen05")
    ap.add_argument("--bucket-mb", type=float, default=128)
    ap.add_argument("--smoke", action="store_true", help="tiny Qwen2 at TP2xPP2; CI")
    args = ap.parse_args()
    if args.smoke:
        args.models, args.bucket_mb = "tiny", 0.25
    bucket = int(args.bucket_mb * (1 << 20))
    jobs = []
    if "tiny" in args.models.split(","):
        jobs.append(
            (
                str(tiny_qwen2_dir()),
                [dict(name="tiny-qwen2", tp=2, pp=2, load=True, infer=[(1, "full"), (2, "shard")])],
            )
        )
    if "smollm2" in args.models:
        jobs.append(
            (
                str(smollm2_dir()),
                [
                    dict(
                        name="SmolLM2-135M",
                        tp=1,
                        pp=2,
                        load=True,
                        infer=[(1, "full"), (1, "shard")],
                    )
                ],
            )
        )
    tmp = None
    if "qwen05" in args.models:
        tmp = tempfile.TemporaryDirectory()
        with open(os.path.join(tmp.name, "config.json"), "w") as f:
            json.dump(QWEN05_CONFIG, f)
        jobs.append(
            (
                tmp.name,
                [
                    dict(
                        name="Qwen2.5-0.5B-shaped",
                        tp=2,
                        pp=2,
                        load=False,
                        infer=[(1, "full"), (1, "shard"), (2, "shard")],
                    )
                ],
            )
        )
    print(
        f"{'model':22} {'layout':12} {'itp':>3} {'mode':5} {'recv/min':>8} "
        f"{'peak/bucket':>11} {'(1+tensor)':>10} {'s/raw':>6} {'seconds':>8} {'buckets':>7}"
    )
    stored = []
    for model_dir, cases in jobs:
        results = run_gloo(worker, 4, model_dir, cases, bucket, timeout=1800)
        stored.append({"model_dir": model_dir, "ranks": results})
        for i, row in enumerate(results[0]):
            per_rank = [r[i] for r in results]
            recv_ratio = max(r["recv"] / max(r["min_recv"], 1) for r in per_rank)
            peak_ratio = max(r["peak"] / r["bucket"] for r in per_rank)
            allowed = 1.0 + row["largest"] / row["bucket"]
            secs = max(r["seconds"] for r in per_rank)
            raw = max(r["raw_seconds"] for r in per_rank)
            print(
                f"{row['model']:22} {row['layout']:12} {row['infer_tp']:>3} {row['mode']:5} "
                f"{recv_ratio:8.2f} {peak_ratio:11.2f} {allowed:10.2f} {secs / raw:6.2f} "
                f"{secs:8.2f} {row['buckets']:7d}"
            )
    if tmp is not None:
        tmp.cleanup()
    write_results(
        "reshard",
        {"bucket_bytes": bucket, "models": args.models, "runs": stored},
        smoke=args.smoke,
        peak_size=256 if args.smoke else 2048,
    )


if __name__ == "__main__":
    main()
