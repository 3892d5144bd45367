"""``megarl plan``: its arguments and what it prints (the subparser lives in megarl/cli.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megarl.plan.hardware import Cluster
from megarl.plan.known_models import known_model_names, resolve_model
from megarl.plan.memory import GPU_BF16, with_grad_bytes
from megarl.plan.pipeline import (
    MeasuredScaling,
    PhaseTimes,
    PlannedScaling,
    format_splits,
    split_table,
)
from megarl.plan.report import format_json, format_text
from megarl.plan.search import Filters, search
from megarl.plan.units import parse_bytes
from megarl.plan.workload import ALGOS, Workload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help=f"HF model folder or config.json, or a known name: {', '.join(known_model_names())}",
    )
    p.add_argument("--gpus", type=int, required=True, help="total GPUs")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 80GiB, 141GB")
    p.add_argument("--seq-len", type=int, default=4096, help="prompt + response tokens")
    p.add_argument("--response-len", type=int, default=None, help="default: half of --seq-len")
    p.add_argument("--batch", type=int, default=1, help="micro-batch: sequences per rank")
    p.add_argument(
        "--tokens-per-micro-batch",
        type=int,
        default=None,
        help="a token budget per micro-batch instead of --batch (actor.max_tokens_per_micro_batch)",
    )
    p.add_argument(
        "--n",
        type=int,
        default=4,
        help="samples per prompt (rollout.sampling.n); divides --global-batch",
    )
    p.add_argument(
        "--global-batch", type=int, default=256, help="sequences per optimizer step (all ranks)"
    )
    p.add_argument("--algo", choices=ALGOS, default="grpo", help="ppo adds a critic")
    p.add_argument("--no-reference", action="store_true", help="no KL term: no reference model")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="actor.lora.rank (all-linear): only adapters train; the base is the reference",
    )
    p.add_argument(
        "--rollout-seqs",
        type=int,
        default=64,
        help="sequences each vLLM engine decodes at once (sizes its KV cache)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="size vLLM like its gpu_memory_utilization instead of by --rollout-seqs",
    )
    p.add_argument("--tp", type=int, default=None, help="only this TP")
    p.add_argument("--pp", type=int, default=None, help="only this PP")
    p.add_argument("--infer-tp", type=int, default=None, help="only this rollout TP")
    p.add_argument(
        "--ep", type=int, default=None, help="MoE models: only this expert parallel size"
    )
    p.add_argument(
        "--param-offload",
        action="store_true",
        help="weights leave the GPU during rollout (actor/ref/critic.param_offload)",
    )
    p.add_argument(
        "--mean-seq-len",
        type=int,
        default=None,
        help="mean real tokens per sequence: with packing (actor.packing) the models compute on "
        "these only (default: --seq-len, no gain)",
    )
    p.add_argument(
        "--packing",
        choices=("on", "off"),
        default=None,
        help="only with / without sequence packing (actor.packing; default: both tried)",
    )
    p.add_argument(
        "--sequence-parallel",
        choices=("on", "off"),
        default=None,
        help="parallel.sequence_parallel at tp > 1 (default: on, as the engine)",
    )
    p.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument(
        "--reserve",
        default=None,
        help="per GPU: CUDA context, NCCL, fragmentation (default: computed for each layout from "
        "its communicators, docs/preflight.md)",
    )
    p.add_argument("--tflops", type=float, default=989.0, help="peak dense bf16 TFLOPS per GPU")
    p.add_argument("--mfu", type=float, default=0.4, help="share of peak training reaches")
    p.add_argument("--top", type=int, default=5, help="layouts in the table")
    p.add_argument("--json", action="store_true", help="print JSON for tools")
    p.add_argument(
        "--async",
        dest="async_split",
        action="store_true",
        help="also rank rollout.placement.mode=async splits (parallel.rollout_ranks) of the GPUs against "
        "colocated, for the fastest layout (pipeline model)",
    )
    p.add_argument(
        "--async-from",
        default=None,
        help="with --async: phase times measured by a colocated run (its trainer.output_dir) "
        "instead of the cost model's",
    )
    p.add_argument(
        "--async-from-devices",
        type=int,
        default=None,
        help="the processes/GPUs that run used (default: --gpus)",
    )


def response_len(args: argparse.Namespace) -> int:
    """Positions the trainer's output layer projects per sequence: the response's."""
    return args.response_len if args.response_len is not None else args.seq_len // 2


def run(args: argparse.Namespace) -> int:
    name, dims = resolve_model(args.model)
    cluster = Cluster(
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu_memory=parse_bytes(args.gpu_memory, "--gpu-memory"),
        reserve=(
            parse_bytes(args.reserve, "--reserve", allow_zero=True)
            if args.reserve is not None
            else None
        ),
        peak_tflops=args.tflops,
        mfu=args.mfu,
    )
    workload = Workload(
        seq_len=args.seq_len,
        micro_batch=args.batch,
        global_batch=args.global_batch,
        algo=args.algo,
        reference=not args.no_reference,
        lora_rank=args.lora_rank,
        response_len=args.response_len,
        rollout_seqs=args.rollout_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        mean_seq_len=args.mean_seq_len,
        micro_batch_tokens=args.tokens_per_micro_batch,
        samples_per_prompt=args.n,
        output_positions=response_len(args),
    )
    numerics = with_grad_bytes(GPU_BF16, 4 if args.grad_dtype == "fp32" else 2)
    filters = Filters(
        tp=args.tp,
        pp=args.pp,
        infer_tp=args.infer_tp,
        ep=args.ep,
        param_offload=args.param_offload,
        packing=None if args.packing is None else args.packing == "on",
        sequence_parallel=None
        if args.sequence_parallel is None
        else args.sequence_parallel == "on",
    )
    result = search(name, dims, cluster, workload, numerics, filters)
    print(format_json(result) if args.json else format_text(result, top=args.top))
    if args.async_split and result.feasible:
        print()
        print(async_splits(args, result))
    return 0


def async_splits(args: argparse.Namespace, result) -> str:
    """The asynchronous splits of the fastest feasible layout, by the pipeline model."""

    best = result.feasible[0]
    layout = best.layout
    planned = PlannedScaling(
        result.dims,
        result.workload,
        best.options,
        result.cluster,
        result.numerics,
        layout.tp,
        layout.pp,
        layout.rollout_tp,
        layout.ep,
    )
    transfer = planned.weight_transfer_s(args.gpus)
    scaling: PlannedScaling | MeasuredScaling
    scaling, switch, source = (
        planned,
        transfer,
        f"cost model, {layout}, infer_tp {layout.rollout_tp}",
    )
    if args.async_from:
        path = Path(args.async_from) / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        phases = PhaseTimes.from_metrics(records, devices=args.async_from_devices or args.gpus)
        scaling, switch = MeasuredScaling(phases), phases.switch_s
        source = f"measured in {args.async_from} on {phases.devices} devices"
    rows = split_table(
        scaling,
        args.gpus,
        layout.rollout_tp,
        switch,
        switch,
        trainer_multiple=layout.tp * layout.pp,
    )
    return format_splits(rows, source)
