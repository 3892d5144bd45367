"""Peak memory and time of vocab-parallel log-prob + entropy vs gather-then-log_softmax, at TP2.

    .venv/bin/python -m bench.logprob                      # CPU-sized default (see below)
    .venv/bin/python -m bench.logprob --batch 8 --methods vocab_parallel   # the issue's size

Each method runs in its own set of gloo processes (one per TP rank), so each gets a clean
high-water mark. Per rank we measure, for forward + backward of ``sum(logprob) + sum(entropy)``:

- time (wall, between barriers);
- peak RSS above the RSS just before the rank's logits shard was created (``ru_maxrss``, the
  kernel's high-water mark, minus that baseline): it counts the input shard, everything the method
  allocates, and the gradient of the shard.

The issue's size is 8 x 1024 tokens x 151,936 vocab (fp32: 5.0 GB per full logits tensor). The
naive method needs several full-size tensors per rank (gathered logits, log-softmax, its exp, their
product, gradients), ~25 GB per rank, so at TP2 it does not fit a 24 GiB machine. The default batch
is therefore 1 (1024 tokens) for both methods; memory of both grows linearly with tokens, so the
ratio carries over. The vocab-parallel method alone does fit at the issue's size (``--batch 8
--methods vocab_parallel``). Nothing is asserted; the figures are printed.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.results_io import write_results
from megarl.algos import vocab_parallel_log_probs_and_entropy
from megarl.ports import free_port

ISSUE_BATCH = 8
GIB = 1024**3


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _naive(shard: torch.Tensor, ids: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    """Gather the full vocabulary on every rank, then log_softmax; the shard's gradient is this
    rank's slice of the full gradient (every rank computes the same loss)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(parts, shard.detach(), group=group)
    full = torch.cat(parts, dim=-1)
    del parts
    full.requires_grad_()
    logp = torch.log_softmax(full, dim=-1)
    lp = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp.sum() + ent.sum()).backward()
    v = shard.shape[-1]
    grad = full.grad[..., rank * v : (rank + 1) * v].contiguous()
    return lp.detach(), ent.detach(), grad


def _vocab_parallel(shard: torch.Tensor, ids: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    shard.requires_grad_()
    lp, ent = vocab_parallel_log_probs_and_entropy(shard, ids, group)
    (lp.sum() + ent.sum()).backward()
    return lp.detach(), ent.detach(), shard.grad


METHODS = {"naive": _naive, "vocab_parallel": _vocab_parallel}


def _worker(rank: int, tp: int, port: int, method: str, shape: tuple[int, int, int], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    fn = METHODS[method]
    batch, seq, vocab = shape
    v_local = vocab // tp
    # Warm up on a tiny problem: gloo connections, kernels, allocator.
    fn(torch.randn(2, 3, 8), torch.randint(0, 8 * tp, (2, 3)), dist.group.WORLD)
    gc.collect()
    dist.barrier()
    base = _rss_bytes()
    gen = torch.Generator().manual_seed(1234 + rank)
    shard = torch.randn(batch, seq, v_local, generator=gen)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(99))
    after_input = _rss_bytes()
    dist.barrier()
    t0 = time.perf_counter()
    lp, ent, grad = fn(shard, ids, dist.group.WORLD)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    peak = _peak_rss_bytes()
    queue.put(
        {
            "rank": rank,
            "time_s": elapsed,
            "peak_gib": (peak - base) / GIB,
            "input_gib": (after_input - base) / GIB,
            "lp_sum": float(lp.double().sum()),
            "ent_sum": float(ent.double().sum()),
            # Row by row: a float64 copy of the whole gradient would not fit at the issue's size.
            "grad_abs_sum": sum(float(g.abs().sum(dtype=torch.float64)) for g in grad),
        }
    )
    dist.destroy_process_group()


def run_method(method: str, tp: int, shape: tuple[int, int, int]) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, tp, port, method, shape, queue)) for r in range(tp)
    ]
    for p in procs:
        p.start()
    results: list = []
    while len(results) < tp:
        if not queue.empty():
            results.append(queue.get())
        elif any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
            codes = [p.exitcode for p in procs]
            raise SystemExit(f"{method}: a rank died (exit codes {codes}; -9 is the OOM killer)")
        else:
            time.sleep(0.2)
    for p in procs:
        p.join()
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1, help=f"sequences (issue: {ISSUE_BATCH})")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=151_936, help="full vocabulary size")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (processes)")
    ap.add_argument(
        "--methods", default="vocab_parallel,naive", help="comma list of: " + ", ".join(METHODS)
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds; CI")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.seq, args.vocab = 1, 64, 4096
    if args.vocab % args.tp:
        raise SystemExit(f"--vocab {args.vocab} must be divisible by --tp {args.tp}")
    shape = (args.batch, args.seq, args.vocab)
    full_gb = args.batch * args.seq * args.vocab * 4 / 1e9
    print(
        f"logprob+entropy fwd+bwd, fp32, TP{args.tp} over gloo, {args.batch} x {args.seq} tokens "
        f"x {args.vocab} vocab (full logits {full_gb:.2f} GB, shard {full_gb / args.tp:.2f} GB)"
    )
    if args.batch != ISSUE_BATCH and not args.smoke:
        print(
            f"NOTE: scaled down from the issue's batch {ISSUE_BATCH} to {args.batch}: the naive "
            "method needs ~5 full-logits tensors per rank, which at the issue's size does not fit "
            "this 24 GiB machine at TP2. Memory scales linearly with tokens for both methods."
        )
    rows = {}
    for method in args.methods.split(","):
        rows[method] = run_method(method, args.tp, shape)
    print(f"{'method':<16}{'time s':>9}{'peak GiB/rank':>15}{'input GiB':>11}   checksums")
    for method, res in rows.items():
        peak = max(r["peak_gib"] for r in res)
        t = max(r["time_s"] for r in res)
        r0 = res[0]
        print(
            f"{method:<16}{t:>9.2f}{peak:>15.2f}{r0['input_gib']:>11.2f}   "
            f"sum lp {r0['lp_sum']:.6e}  sum H {r0['ent_sum']:.6e}  "
            f"sum|grad| {sum(r['grad_abs_sum'] for r in res):.6e}"
        )
    if "naive" in rows and "vocab_parallel" in rows:
        ratio = max(r["peak_gib"] for r in rows["vocab_parallel"]) / max(
            r["peak_gib"] for r in rows["naive"]
        )
        t_ratio = max(r["time_s"] for r in rows["vocab_parallel"]) / max(
            r["time_s"] for r in rows["naive"]
        )
        print(
            f"vocab_parallel / naive: peak memory per rank {ratio:.2f}x (target <= 0.6x), "
            f"time {t_ratio:.2f}x"
        )
    write_results(
        "logprob",
        {"batch": args.batch, "seq": args.seq, "vocab": args.vocab, "tp": args.tp, "ranks": rows},
        smoke=args.smoke,
        peak_size=256 if args.smoke else 2048,
    )


if __name__ == "__main__":
    main()
