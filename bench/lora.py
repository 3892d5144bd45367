"""Peak memory and step time of a GRPO actor update of SmolLM2-135M with LoRA (rank 64, alpha 16,
every linear layer) against full fine-tuning, measured in the same run.

    .venv/bin/python -m bench.lora [--batch 4] [--seq 256] [--iters 3] [--rank 64] [--rounds 3]
    .venv/bin/python -m bench.lora --smoke        # a tiny model, one step each (CI)

One actor update = forward + backward of the PPO-clip loss (GRPO's policy loss) over
vocab-parallel response logprobs + one distributed-optimizer step, through the same megatron
DDP + optimizer megarl trains with (TP1, one process, fp32). Each variant runs in its own
process, so its peak memory is its own: on CUDA ``torch.cuda.max_memory_allocated``, on a CPU
the process's peak RSS (which includes the imports of torch, megatron and transformers, the same
for both). Beside it, the training state counted tensor by tensor: weights, gradient buffers,
optimizer parameters and Adam's moments. The variants run ``--rounds`` times, alternated
(bench/rounds.py); prints the ratio LoRA / full of each round and their median, which the
results file keeps with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.rounds import print_ratio, print_rounds, ratio_by_round, run_rounds

ROOT = Path(__file__).resolve().parents[1]


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_bytes(model, ddp, optimizer) -> dict[str, int]:
    import torch

    moments = [
        t
        for opt in getattr(optimizer, "chained_optimizers", [optimizer])
        for s in opt.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    ]
    grads = [b.grad_data for b in ddp.buffers]
    return {
        "weights": _tensor_bytes(model.parameters()),
        "grads": _tensor_bytes(grads),
        "optimizer": _tensor_bytes(moments),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def run_variant(args: argparse.Namespace) -> dict[str, float]:
    """One variant in this process: returns its timings and memory (printed as JSON)."""
    import torch
    import torch.distributed as dist

    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + (os.getpid() % 300)))
    dist.init_process_group("gloo", rank=0, world_size=1)

    from megarl.algos.policy_loss import ppo_clip
    from megarl.algos.vocab_parallel import vocab_parallel_log_probs
    from megarl.models.build import build_model
    from megarl.models.distributed import OptimSettings, wrap_for_training
    from megarl.models.forward import run_schedule
    from megarl.models.lora import LoraSettings, add_lora_for_layout
    from megarl.parallel import ParallelLayout, initialize_model_parallel, tp_group
    from megarl.platform import adapt_megatron_for_cpu, device
    from megarl.tools.testing.assets import smollm2_dir, tiny_qwen2_dir

    adapt_megatron_for_cpu()
    model_dir = tiny_qwen2_dir() if args.smoke else smollm2_dir()
    layout = ParallelLayout()
    initialize_model_parallel(layout)
    model, dims = build_model(model_dir, layout)
    if args.variant == "lora":
        add_lora_for_layout(model, dims, layout, LoraSettings(rank=args.rank, alpha=16.0))
    ddp, optimizer, _ = wrap_for_training(model, OptimSettings(lr=1e-5))

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, dims.vocab_size, (args.batch, args.seq), generator=gen).to(device())
    labels = torch.roll(ids, -1, dims=1)
    mask = torch.zeros(args.batch, args.seq, device=device())
    mask[:, args.seq // 2 : -1] = 1.0  # the response half; the last position has no next token
    advantages = torch.randn(args.batch, args.seq, generator=gen).to(device())

    def loss_fn(logits, batch):
        log_prob = vocab_parallel_log_probs(logits, labels, group=tp_group())
        per_token, _ = ppo_clip(log_prob.detach(), log_prob, advantages, mask)
        return (per_token * mask).sum() / mask.sum(), {}  # token-mean, as GRPO's default

    def step() -> None:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        run_schedule([ddp], [{"input_ids": ids}], loss_fn, forward_only=False)
        optimizer.step()

    step()  # warm-up: Adam's states exist from here on
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    out = {"step_s": statistics.median(times), "peak_bytes": float(peak)}
    out.update({k: float(v) for k, v in _state_bytes(model, ddp, optimizer).items()})
    dist.destroy_process_group()
    return out


def _child(variant: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, "-m", "bench.lora", "--variant", variant, "--batch", str(args.batch)]
    cmd += ["--seq", str(args.seq), "--iters", str(args.iters), "--rank", str(args.rank)]
    cmd += ["--smoke"] if args.smoke else []
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        sys.exit(f"{variant} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument(
        "--rounds",
        type=int,
        help="runs of each variant, the order reversed each round (3; smoke 1)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, one timed step")
    parser.add_argument("--variant", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.seq, args.iters, args.rank = 2, 32, 1, 8
    if args.rounds is None:
        args.rounds = 1 if args.smoke else 3
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    rounds = run_rounds(("full", "lora"), args.rounds, lambda variant: _child(variant, args))
    model = "tiny Qwen2 (smoke)" if args.smoke else "SmolLM2-135M"
    mib = 2**20
    print(
        f"{model} GRPO actor update (PPO-clip loss + Adam step), batch {args.batch} x seq "
        f"{args.seq}, fp32, TP1, LoRA rank {args.rank} alpha 16 all-linear vs full fine-tuning, "
        f"{args.rounds} alternated rounds"
    )
    print_rounds(
        rounds,
        lambda r: (
            f"{r['step_s'] * 1e3:9.1f} ms/step  peak {r['peak_bytes'] / mib:8.1f} MiB  trainable "
            f"{r['trainable_params'] / 1e6:7.2f}M weights {r['weights'] / mib:7.1f} grads "
            f"{r['grads'] / mib:7.1f} optimizer {r['optimizer'] / mib:7.1f} MiB"
        ),
    )
    state = ("weights", "grads", "optimizer")
    by_round = {
        "step_time": ratio_by_round(rounds, lambda r: r["lora"]["step_s"] / r["full"]["step_s"]),
        "peak_memory": ratio_by_round(
            rounds, lambda r: r["lora"]["peak_bytes"] / r["full"]["peak_bytes"]
        ),
    }
    last = rounds[-1]  # the training state is counted, the same in every round
    ratios = {
        "step_time": by_round["step_time"]["median"],
        "peak_memory": by_round["peak_memory"]["median"],
        "training_state": sum(last["lora"][k] for k in state) / sum(last["full"][k] for k in state),
    }
    for key, ratio in by_round.items():
        print_ratio(f"lora/full {key}", ratio)
    print(
        f"RATIO lora/full (median of the rounds): step time {ratios['step_time']:.2f}, peak "
        f"memory {ratios['peak_memory']:.2f}, training state (weights+grads+optimizer) "
        f"{ratios['training_state']:.2f}"
    )
    from bench.results_io import write_results

    figures = {"model": model, **vars(args), "rounds_run": rounds, "ratios_by_round": by_round}
    figures.update(full=last["full"], lora=last["lora"], lora_over_full=ratios)
    write_results("lora", figures, smoke=args.smoke, peak_size=256 if args.smoke else None)


if __name__ == "__main__":
    main()
