"""Tokens/s of one SmolLM2-135M training step (forward + backward + optimizer step) through megarl
at TP1, against Hugging Face transformers with torch AdamW on the same batch, in the same run.

    .venv/bin/python -m bench.train_step [--batch 4] [--seq 256] [--iters 5] [--dtype float32]
    .venv/bin/python -m bench.train_step --smoke          # seconds: tiny sizes, nothing stored
    .venv/bin/python -m bench.train_step --megatron-paths # + megarl on megatron's own CPU paths
    .venv/bin/python -m bench.train_step --matmuls 12     # + each side's matmuls by shape

Both sides: the same token ids, next-token cross-entropy over every position but the last, AdamW
(lr 1e-5, weight decay 0.01, eps 1e-8) with gradient clipping at 1.0, in torch's fused AdamW
kernel. megarl runs megatron's DDP (fp32 grad buffer) + distributed optimizer (whose torch AdamW
megarl switches to the fused kernel); transformers runs ``model(input_ids, labels).loss``
backward, ``clip_grad_norm_`` and ``torch.optim.AdamW(fused=True)``, what its ``Trainer`` uses by
default (``adamw_torch_fused``). With ``--dtype bfloat16`` both sides train in mixed precision:
transformers under CPU autocast to bf16 on fp32 weights (its Trainer's ``bf16=True``), megarl with
bf16 weights and fp32 main weights and Adam states. Both models
live side by side and their steps alternate (a change of load hits both alike). Prints
ms/step, tokens/s, the ratio megarl / transformers (target >= 1.0) and each side's share of the
matmul peak measured in this run (model FLOPs: 6 x linear parameters per token + 12 x layers x
hidden x sequence per token for attention, the usual "MFU" count). Writes
bench/results/train_step.json. Nothing is asserted.

``--megatron-paths`` adds a third side, alternating with the two: megarl with megatron-core's own
code where megarl replaces it (the unfused rope, the copying clip-grad scale, the sequence-major
output layer with its logits copies, torch's single-tensor Adam; see megarl.models.rotary,
grad_scale, forward, fused_adam), and prints the speed-up of megarl's paths over them.
``--profile N`` prints each side's top N ops. ``--matmuls N`` times every matmul of one more step
of each side and prints the N costliest shapes with their GFLOP/s and the page faults inside them
(bench/matmul_census.py); the figures go into the results file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.matmul_census import census_record, matmul_census, print_census
from bench.results_io import load_1min, matmul_peaks, write_results

LR, WEIGHT_DECAY, EPS, CLIP = 1e-5, 0.01, 1e-8, 1.0
MEGATRON_PATHS = "megarl on megatron's paths"


def _time_alternating(fns: dict, iters: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each step function, run in turn (a, b, a, b, ...) so that a change of load on a
    shared machine hits both sides alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples


def print_profiles(fns: dict, top: int) -> None:
    """One torch.profiler step per side: the top ``top`` ops by self CPU time, shares comparable
    within a table (seconds across runs on a shared machine are not)."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in fns.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        print(f"\nprofile of one {name} step (self CPU time, top {top}):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def train_flops_per_token(hf_model, seq: int) -> float:
    """6 x (parameters of every linear layer, LM head included) + 12 x layers x hidden x seq."""
    import torch

    linear = sum(m.weight.numel() for m in hf_model.modules() if isinstance(m, torch.nn.Linear))
    cfg = hf_model.config
    return 6.0 * linear + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds; CI")
    parser.add_argument(
        "--megatron-paths",
        action="store_true",
        help="also time megarl on megatron's own rope, clip-grad scale and output layout",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, profile one step of each side and print its top N ops by self CPU time",
    )
    parser.add_argument(
        "--matmuls",
        type=int,
        default=0,
        metavar="N",
        help="after timing, time every matmul of one step of each side; print the N costliest",
    )
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.seq, args.iters, args.warmup = 1, 32, 1, 1

    import torch
    import torch.distributed as dist

    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    peaks = matmul_peaks(256 if args.smoke else 2048)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)

    from megatron.core import tensor_parallel
    from transformers import AutoModelForCausalLM

    from megarl.models.build import ModelOptions, build_model
    from megarl.models.distributed import OptimSettings, wrap_for_training
    from megarl.models.forward import run_schedule, use_batch_major_output
    from megarl.models.fused_adam import use_fused_adam
    from megarl.models.grad_scale import megatron_grad_scaling
    from megarl.models.rotary import megatron_rotary
    from megarl.parallel import ParallelLayout, initialize_model_parallel
    from megarl.platform import adapt_megatron_for_cpu
    from megarl.tools.testing.assets import smollm2_dir

    adapt_megatron_for_cpu()
    dtype = getattr(torch, args.dtype)
    model_dir = smollm2_dir()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (args.batch, args.seq), generator=gen)
    tokens = args.batch * args.seq

    # In bf16 transformers runs as its Trainer does with ``bf16=True``: fp32 weights and AdamW
    # states, the forward and backward under CPU autocast to bf16. That is megarl's mixed
    # precision too (bf16 compute, fp32 main weights and Adam states in the distributed
    # optimizer); pure-bf16 weights on the HF side would not be like for like.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.train()
    flops_per_token = train_flops_per_token(hf, args.seq)
    # transformers' Trainer default optimizer ("adamw_torch_fused" with torch >= 2.8)
    hf_opt = torch.optim.AdamW(
        hf.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS, fused=True
    )
    hf_autocast = dtype == torch.bfloat16

    def hf_step():
        hf_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=hf_autocast):
            loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)
        hf_opt.step()

    layout = ParallelLayout()
    initialize_model_parallel(layout)
    optim = OptimSettings(lr=LR, weight_decay=WEIGHT_DECAY, adam_eps=EPS, clip_grad=CLIP)
    ddp, optimizer, _ = wrap_for_training(
        build_model(model_dir, layout, opts=ModelOptions(dtype=dtype))[0], optim
    )

    labels = torch.roll(ids, -1, dims=1)
    mask = torch.ones_like(ids, dtype=torch.float32)
    mask[:, -1] = 0.0  # the last position has no next token

    def loss_fn(logits, batch):
        # Shifted labels instead of slicing the logits: no copy of the [b, s, vocab] tensor.
        per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels)
        return (per_token * mask).sum() / mask.sum(), {}

    def megarl_step(ddp=ddp, optimizer=optimizer):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        run_schedule([ddp], [{"input_ids": ids}], loss_fn, forward_only=False)
        optimizer.step()

    steps = {"transformers": hf_step, "megarl": megarl_step}
    if args.megatron_paths:
        ddp_m, optimizer_m, _ = wrap_for_training(
            build_model(model_dir, layout, opts=ModelOptions(dtype=dtype))[0], optim
        )
        use_batch_major_output(ddp_m, False)
        use_fused_adam(optimizer_m, on=False)

        def megatron_paths_step():
            with megatron_rotary(), megatron_grad_scaling():
                megarl_step(ddp_m, optimizer_m)

        steps[MEGATRON_PATHS] = megatron_paths_step
    samples = _time_alternating(steps, args.iters, args.warmup)
    if args.profile:
        print_profiles(steps, args.profile)
    census = {}
    for name, step in steps.items() if args.matmuls else ():
        groups, faulted_mib = matmul_census(step)
        print_census(name, groups, faulted_mib, args.matmuls)
        census[name] = census_record(groups, faulted_mib)
    hf_samples, mg_samples = samples["transformers"], samples["megarl"]
    hf_s, mg_s = statistics.median(hf_samples), statistics.median(mg_samples)
    peaks_end = matmul_peaks.__wrapped__(256 if args.smoke else 2048)
    # The better of the two measurements: on a shared machine either may have met other load.
    key = "bf16_gflops" if dtype == torch.bfloat16 else "fp32_gflops"
    peak = max(peaks[key], peaks_end[key])

    def share(seconds: float) -> float:
        return flops_per_token * tokens / seconds / 1e9 / peak

    print(
        f"SmolLM2-135M training step (fwd+bwd+AdamW), batch {args.batch} x seq {args.seq}, "
        f"{threads} threads, {args.dtype}, CPU; load {load_1min():.1f}"
    )
    print(
        f"  matmul peak measured now: fp32 {peaks['fp32_gflops']:.0f} GFLOP/s, "
        f"bf16 {peaks['bf16_gflops']:.0f} GFLOP/s (after the steps: fp32 "
        f"{peaks_end['fp32_gflops']:.0f}, bf16 {peaks_end['bf16_gflops']:.0f}); "
        f"{flops_per_token / 1e9:.2f} GFLOP/token; median of {args.iters} steps each, alternated"
    )
    print(
        f"  transformers+AdamW: {hf_s * 1e3:8.1f} ms/step  {tokens / hf_s:8.1f} tokens/s  "
        f"{100 * share(hf_s):5.1f}% of peak"
    )
    print(
        f"  megarl TP1:         {mg_s * 1e3:8.1f} ms/step  {tokens / mg_s:8.1f} tokens/s  "
        f"{100 * share(mg_s):5.1f}% of peak"
    )
    print(f"RATIO megarl/transformers tokens/s = {hf_s / mg_s:.2f} (target >= 1.0)")
    extra = {}
    if MEGATRON_PATHS in samples:
        base_s = statistics.median(samples[MEGATRON_PATHS])
        print(
            f"  {MEGATRON_PATHS}: {base_s * 1e3:8.1f} ms/step  {tokens / base_s:8.1f} tokens/s  "
            f"{100 * share(base_s):5.1f}% of peak"
        )
        print(f"RATIO megarl's paths / megatron's paths tokens/s = {base_s / mg_s:.3f}")
        extra = {
            "megatron_paths_s_per_step": base_s,
            "megatron_paths_samples_s": samples[MEGATRON_PATHS],
            "ratio_megarl_paths_over_megatron_paths": base_s / mg_s,
        }
    write_results(
        "train_step" if args.dtype == "float32" else f"train_step_{args.dtype}",
        {
            "model": "SmolLM2-135M-Instruct",
            "batch": args.batch,
            "seq": args.seq,
            "dtype": args.dtype,
            "threads": threads,
            "iters": args.iters,
            "gflop_per_token": flops_per_token / 1e9,
            "transformers_s_per_step": hf_s,
            "transformers_samples_s": hf_samples,
            "transformers_tokens_per_s": tokens / hf_s,
            "transformers_share_of_peak": share(hf_s),
            "megarl_s_per_step": mg_s,
            "megarl_samples_s": mg_samples,
            "megarl_tokens_per_s": tokens / mg_s,
            "megarl_share_of_peak": share(mg_s),
            "ratio_megarl_over_transformers": hf_s / mg_s,
            **extra,
            **({"matmul_census": census} if census else {}),
            "matmul_peaks_after": peaks_end,
            "peak_used_gflops": peak,
            "sides": {
                "transformers": "HF forward with labels, backward, clip_grad_norm_, "
                "torch AdamW(fused=True) on fp32 weights"
                + (", forward and backward under CPU autocast to bf16" if hf_autocast else ""),
                "megarl": "megatron GPTModel TP1, DDP fp32 grad buffer, distributed optimizer "
                "(torch's fused AdamW)"
                + (", bf16 weights with fp32 main weights and Adam states" if hf_autocast else ""),
                "process": "both sides in this process: the same environment (process_env)",
            },
        },
        smoke=args.smoke,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
