"""A short demo of the model layer: build a model in 3D parallel from a Hugging Face checkpoint,
then print how its logits, loss and one training step compare with transformers on one process.

Run ``megarl demo`` (it launches torchrun itself).
"""

from __future__ import annotations

import argparse
import time

from megarl import parallel
from megarl.console import quiet_rank_console
from megarl.parallel import ParallelLayout, initialize_model_parallel
from megarl.tools.testing import assets

MODELS = ("tiny-qwen2", "tiny-llama", "smollm2")


def resolve_model(name: str) -> str:
    builders = {
        "tiny-qwen2": assets.tiny_qwen2_dir,
        "tiny-llama": assets.tiny_llama_dir,
        "smollm2": assets.smollm2_dir,
    }
    return str(builders[name]()) if name in builders else name


def _rank_report(model_dir: str, tp: int, pp: int, seq: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from megarl import platform
    from megarl.models.build import build_model
    from megarl.models.forward import forward_logits

    layout = ParallelLayout.for_world(dist.get_world_size(), tp=tp, pp=pp)
    initialize_model_parallel(layout)
    t0 = time.perf_counter()
    model, dims = build_model(model_dir, layout)
    load_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(parallel.dp_rank())
    ids = torch.randint(0, dims.vocab_size, (2, seq), generator=gen, device="cpu")
    t0 = time.perf_counter()
    logits = forward_logits([model], ids.to(platform.device()))
    fwd_s = time.perf_counter() - t0
    report = {"rank": dist.get_rank(), "layout": str(layout), "load_s": load_s, "forward_s": fwd_s}
    if logits is not None:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(ids).logits
        logits = logits.float().cpu()
        report["max_abs_logit_diff"] = (logits - ref).abs().max().item()
        report["max_abs_logit"] = ref.abs().max().item()
        report["greedy_token_agreement"] = (
            (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        )
    return report


# Parity holds when the worst |logit difference| of any last-stage rank is below this share of the
# largest |logit| (fp32 sums in a different order differ by ~1e-7 relative).
RELATIVE_TOLERANCE = 1e-4


def parity_verdict(reports: list[dict]) -> tuple[bool, float]:
    """(parity ok, worst |logits - transformers|) over the ranks' reports; only last-stage ranks
    carry logits. No logits at all counts as a mismatch, not a pass."""
    diffs = [r["max_abs_logit_diff"] for r in reports if "max_abs_logit_diff" in r]
    if not diffs:
        return False, float("nan")
    worst = max(diffs)
    scale = max(r["max_abs_logit"] for r in reports if "max_abs_logit" in r)
    return worst < RELATIVE_TOLERANCE * scale, worst


def main(argv: list[str] | None = None) -> int:
    quiet_rank_console()  # before torch, megatron or transformers are imported
    import torch.distributed as dist

    from megarl.launch import init_distributed

    parser = argparse.ArgumentParser(prog="megarl demo (rank)")
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args(argv)
    rank, world = init_distributed()
    model_dir = resolve_model(args.model) if rank == 0 else None
    box: list = [model_dir]
    dist.broadcast_object_list(box, src=0)
    report = _rank_report(box[0], args.tp, args.pp, args.seq)
    reports: list = [None] * world
    dist.all_gather_object(reports, report)
    ok, worst = parity_verdict(reports)  # every rank has every report: all exit alike
    if rank == 0:
        print(f"\nmegarl demo: {args.model} on {world} ranks, layout {reports[0]['layout']}")
        print(
            f"  load {max(r['load_s'] for r in reports):.2f}s, forward {max(r['forward_s'] for r in reports):.3f}s"
        )
        for r in reports:
            if "max_abs_logit_diff" in r:
                rel = r["max_abs_logit_diff"] / r["max_abs_logit"]
                print(
                    f"  rank {r['rank']} (last stage): max |logits - transformers| = "
                    f"{r['max_abs_logit_diff']:.2e} (relative {rel:.2e}), "
                    f"greedy-token agreement {r['greedy_token_agreement']:.3f}"
                )
        print(f"PARITY {'OK' if ok else 'MISMATCH'}: worst {worst:.2e}")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
