"""Tokens/s and peak memory of one actor update (PPO loss, forward + backward + Adam step), padded
micro-batches against packed ones (``actor.packing``), on SmolLM2-135M at TP1, same run.

    .venv/bin/python -m bench.packing [--samples 12] [--max-tokens 4096] [--iters 1] [--rounds 3]
    .venv/bin/python -m bench.packing --smoke      # tiny model, a few samples: seconds

Response lengths are drawn like GSM8K answers: a log-normal body (median ~120 tokens) with a long
tail up to ``--max-response`` tokens; prompts 60-160 tokens. Both modes cut micro-batches by the
same token budget (``actor.max_tokens_per_micro_batch``): padded tokens when padded, real tokens
when packed. Each mode runs in its own process so its peak memory is its own: the peak resident
memory during the update above the resident memory before it (on CUDA: peak allocated bytes).
Tokens/s counts real tokens (prompt + response) per second of the median update. The modes run
``--rounds`` times, alternated (bench/rounds.py); prints each round's and ``RATIO packed/padded``,
the median of the rounds (target >= 1.5).
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
from megarl.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def gsm8k_like_lengths(n: int, max_response: int, seed: int) -> tuple[list[int], list[int]]:
    """Prompt and response lengths shaped like GSM8K chat prompts and answers (long tail)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(60, 161, (n,), generator=gen)
    body = torch.empty(n).log_normal_(mean=4.8, std=0.55, generator=gen)  # median e^4.8 ~ 120
    responses = body.round().clamp(8, max_response).long()
    return prompts.tolist(), responses.tolist()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_mode(args: argparse.Namespace) -> dict[str, float]:
    """One process: build the actor, time ``iters`` updates after one warm-up, in one mode."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    dist.init_process_group("gloo", rank=0, world_size=1)

    from megarl.config import RunConfig
    from megarl.models.build import build_model
    from megarl.models.distributed import OptimSettings, wrap_for_training
    from megarl.parallel import ParallelLayout, initialize_model_parallel
    from megarl.platform import adapt_megatron_for_cpu
    from megarl.run.trainable import Trainable
    from megarl.tools.testing.assets import smollm2_dir, tiny_qwen2_dir
    from megarl.trainer.batch import Samples
    from megarl.trainer.model_ops import MicroBatching, ppo_update
    from megarl.trainer.spec import resolve_algorithm

    adapt_megatron_for_cpu()
    model_dir = tiny_qwen2_dir() if args.smoke else smollm2_dir()
    layout = ParallelLayout()
    initialize_model_parallel(layout)
    model, dims = build_model(model_dir, layout)
    ddp, optimizer, scheduler = wrap_for_training(model, OptimSettings(lr=1e-6))
    trainable = Trainable(model, ddp, optimizer, scheduler)

    prompt_lens, response_lens = gsm8k_like_lengths(args.samples, args.max_response, seed=0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, dims.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    responses = [
        torch.randint(1, dims.vocab_size, (n,), generator=gen).tolist() for n in response_lens
    ]
    device = next(model.parameters()).device
    samples = Samples.from_sequences(prompts, responses, list(range(args.samples)), 0, device)
    shape = samples.response_mask.shape
    samples.tensors.advantages = torch.randn(shape, generator=gen).to(device)
    samples.tensors.old_log_prob = (-torch.rand(shape, generator=gen) * 8).to(device)
    samples.tensors.ref_log_prob = samples.tensors.require("old_log_prob").clone()
    cfg = RunConfig()
    loss_fn = resolve_algorithm(
        cfg.algorithm, cfg.rollout.sampling, cfg.actor, cfg.critic, cfg.data, dims.vocab_size
    ).actor_loss
    batching = MicroBatching(args.samples, args.max_tokens, args.mode == "packed")
    rows = list(range(args.samples))

    def update() -> None:
        ppo_update(trainable, "actor", samples, [rows], 1, batching, loss_fn, token_level=True)

    cuda = device.type == "cuda"
    rss_before = _rss_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        allocated_before = torch.cuda.memory_allocated()
    update()  # warm-up
    times = []
    for _ in range(args.iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        update()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - allocated_before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    seconds = statistics.median(times)
    real_tokens = int(samples.seq_lens().sum())
    mbs = batching.split(samples, rows)
    model_tokens = sum(
        int(mb.seq_lens().sum()) if batching.packing else mb.input_ids.numel() for _, mb in mbs
    )
    dist.destroy_process_group()
    return {
        "seconds": seconds,
        "tokens_per_s": real_tokens / seconds,
        "real_tokens": real_tokens,
        "model_tokens": model_tokens,
        "micro_batches": len(mbs),
        "peak_bytes": max(peak, 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few samples")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--max-response", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument(
        "--rounds", type=int, help="runs of each mode, the order reversed each round (3; smoke 1)"
    )
    parser.add_argument("--mode", choices=["padded", "packed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 1 if args.smoke else 3
    size = dict(samples=6, max_tokens=512, max_response=96, iters=1) if args.smoke else {}
    defaults = dict(samples=12, max_tokens=4096, max_response=512, iters=1)
    for key, value in {**defaults, **size}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    if args.mode:
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return

    rounds = run_rounds(("padded", "packed"), args.rounds, lambda mode: _run_mode(mode, args))
    name = "tiny Qwen2 (smoke)" if args.smoke else "SmolLM2-135M"
    threads = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))
    print(
        f"{name}, one actor update (PPO loss, fwd+bwd+Adam), {args.samples} samples, "
        f"GSM8K-like response lengths (max {args.max_response}), token budget "
        f"{args.max_tokens}/micro-batch, {threads} threads, fp32, {args.rounds} alternated rounds"
    )
    print_rounds(
        rounds,
        lambda r: (
            f"{r['seconds']:8.2f} s/update {r['tokens_per_s']:9.1f} tokens/s  "
            f"{r['model_tokens']:6d} tokens through the model ({r['real_tokens']} real), "
            f"{r['micro_batches']} micro-batches, peak memory +{r['peak_bytes'] / 2**20:.0f} MiB"
        ),
    )
    speed = ratio_by_round(
        rounds, lambda r: r["packed"]["tokens_per_s"] / r["padded"]["tokens_per_s"]
    )
    memory = ratio_by_round(
        rounds, lambda r: r["packed"]["peak_bytes"] / max(r["padded"]["peak_bytes"], 1)
    )
    for what, by_round in (("tokens/s", speed), ("peak", memory)):
        print_ratio(f"packed/padded {what}", by_round)
    print(f"RATIO packed/padded tokens/s = {speed['median']:.2f} (median; target >= 1.5)")
    print(f"MEMORY packed/padded peak = {memory['median']:.2f} (median)")
    from bench.results_io import write_results

    figures = {"model": name, "threads": threads, **vars(args), "runs": rounds[-1]}
    figures.update(rounds_run=rounds, ratios_by_round={"tokens_per_s": speed, "peak": memory})
    figures.update(
        packed_over_padded_tokens_per_s=speed["median"], packed_over_padded_peak=memory["median"]
    )
    write_results("packing", figures, smoke=args.smoke, peak_size=256 if args.smoke else None)


def _run_mode(mode: str, args: argparse.Namespace) -> dict:
    """One mode's update in a process of its own (its peak memory its own)."""
    cmd = [sys.executable, "-m", "bench.packing", "--mode", mode]
    cmd += ["--samples", str(args.samples), "--max-tokens", str(args.max_tokens)]
    cmd += ["--max-response", str(args.max_response), "--iters", str(args.iters)]
    if args.smoke:
        cmd.append("--smoke")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"the {mode} run failed (exit code {proc.returncode})")
    return json.loads(lines[-1][len("RESULT ") :])


if __name__ == "__main__":
    main()
