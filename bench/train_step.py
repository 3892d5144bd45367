"""Tokens/s of one forward+backward of SmolLM2-135M (sequence 256) through megarl at TP1, against
Hugging Face transformers' own training step on the same batch, measured in the same run.

    .venv/bin/python bench/train_step.py [--batch 4] [--seq 256] [--iters 5]

Prints both throughputs and the ratio megarl / transformers (target >= 1.0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _time(fn, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)

    from megatron.core import tensor_parallel
    from transformers import AutoModelForCausalLM

    from megarl.models.build import build_model
    from megarl.models.distributed import OptimSettings, wrap_for_training
    from megarl.models.forward import run_schedule
    from megarl.parallel import ParallelLayout, initialize_model_parallel
    from megarl.platform import adapt_megatron_for_cpu
    from megarl.testing.assets import smollm2_dir

    adapt_megatron_for_cpu()
    model_dir = smollm2_dir()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (args.batch, args.seq), generator=gen)
    tokens = args.batch * args.seq

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.train()

    def hf_step():
        hf.zero_grad(set_to_none=True)
        hf(input_ids=ids, labels=ids).loss.backward()

    hf_s = _time(hf_step, args.iters)
    hf_step = hf = None  # free the HF model before building megarl's

    layout = ParallelLayout()
    initialize_model_parallel(layout)
    model, _ = build_model(model_dir, layout)
    ddp, _, _ = wrap_for_training(model, OptimSettings())

    labels = torch.roll(ids, -1, dims=1)
    mask = torch.ones_like(ids, dtype=torch.float32)
    mask[:, -1] = 0.0  # the last position has no next token

    def loss_fn(logits, batch):
        # Shifted labels instead of slicing the logits: no copy of the [b, s, vocab] tensor.
        per_token = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
        return (per_token * mask).sum() / mask.sum(), {}

    def megarl_step():
        ddp.zero_grad_buffer()
        run_schedule([ddp], [{"input_ids": ids}], loss_fn, forward_only=False)

    mg_s = _time(megarl_step, args.iters)
    print(
        f"SmolLM2-135M forward+backward, batch {args.batch} x seq {args.seq}, {threads} threads, fp32, CPU"
    )
    print(f"  transformers: {hf_s * 1e3:8.1f} ms/step  {tokens / hf_s:8.1f} tokens/s")
    print(f"  megarl TP1:   {mg_s * 1e3:8.1f} ms/step  {tokens / mg_s:8.1f} tokens/s")
    print(f"RATIO megarl/transformers tokens/s = {hf_s / mg_s:.2f} (target >= 1.0)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
