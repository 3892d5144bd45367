"""Seconds and peak memory of exporting a megatron checkpoint to Hugging Face (printed, not asserted).

    .venv/bin/python -m bench.convert [--model smollm2] [--tp 1 --pp 2] [--dtype float32]

Converts the model to a megarl checkpoint at the given layout (SmolLM2-135M has 9 heads: TP2 is
impossible, so the default is the nearest layout that fits, TP3xPP2 = 6 processes), then exports it
back in a fresh process and measures that process: its baseline RSS (imports done, checkpoint
metadata read), its peak RSS during the export (Linux VmHWM, reset after the baseline), the
largest tensor bucket (one megatron tensor), the largest single read (a saved chunk, for the
streamed embedding and LM head) and the model size. The target is a peak below
baseline + 1.5 x the largest bucket, independent of the model size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results_io import write_results

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
from pathlib import Path

def rss_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])

from checkpoints_tools.mcore_to_hf import export_to_hf, plan_groups
from megarl.checkpoint.reader import DistCheckpointReader
from megarl.checkpoint.store import checkpoint_dims, read_meta, resolve_checkpoint
import torch

ckpt, out, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
meta = read_meta(ckpt)
with DistCheckpointReader(resolve_checkpoint(ckpt) / "mcore") as r:
    groups = plan_groups(checkpoint_dims(ckpt), meta.role, r)

    def size(g, shape):
        return torch.empty((), dtype=r.dtype(g.key)).element_size() * torch.Size(shape).numel()

    src_bytes = [size(g, g.source_shape) for g in groups]
    # what one read holds: a saved chunk for streamed embeddings / LM heads, else the tensor
    read_bytes = [
        max(size(g, s) for _, s in r.chunks(g.key)) if g.streams_rows else size(g, g.source_shape)
        for g in groups
    ]
baseline = rss_kib("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
t0 = time.perf_counter()
res = export_to_hf(ckpt, out, dtype=dtype, progress=False, overwrite=True)
seconds = time.perf_counter() - t0
print(json.dumps(dict(
    seconds=seconds, baseline_kib=baseline, peak_kib=rss_kib("VmHWM"),
    largest_bucket=max(src_bytes), largest_read=max(read_bytes), model_bytes=sum(src_bytes),
    out_bytes=res.bytes,
    files=res.files, tensors=res.tensors,
)))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2", help="smollm2 | tiny-qwen2 | tiny-llama | dir"
    )
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--workdir", default=None, help="keep the checkpoint and export here")
    parser.add_argument("--smoke", action="store_true", help="tiny model, TP1xPP2; CI")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.tp, args.pp = "tiny-qwen2", 1, 2

    from megarl.tools.demo import resolve_model

    hf_dir = resolve_model(args.model)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="megarl-bench-convert-"))
    ckpt, out = work / "ckpt", work / "hf"
    py = sys.executable
    t0 = time.perf_counter()
    subprocess.run(
        [py, "-m", "checkpoints_tools", "hf-to-mcore", "--hf", hf_dir, "--out", str(ckpt),
         "--tp", str(args.tp), "--pp", str(args.pp), "--overwrite"],
        check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    to_mcore = time.perf_counter() - t0
    child = subprocess.run(
        [py, "-c", CHILD, str(ckpt), str(out), args.dtype],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if child.returncode:
        print(child.stderr[-3000:], file=sys.stderr)
        return child.returncode
    r = json.loads(child.stdout.strip().splitlines()[-1])
    mib = 1 / 2**20
    extra = (r["peak_kib"] - r["baseline_kib"]) * 1024
    target = 1.5 * r["largest_bucket"]
    print(f"bench/convert: {args.model} ({hf_dir}), checkpoint saved at TP{args.tp}xPP{args.pp}")
    print(f"  hf-to-mcore ({args.tp * args.pp} processes, incl. start-up): {to_mcore:.1f} s")
    print(
        f"  mcore-to-hf (1 process, {args.dtype}): {r['seconds']:.2f} s, "
        f"{r['tensors']} tensors in {r['files']} file(s), {r['out_bytes'] * mib:.0f} MiB written "
        f"({r['out_bytes'] * mib / max(r['seconds'], 1e-9):.0f} MiB/s)"
    )
    print(
        f"  model {r['model_bytes'] * mib:.0f} MiB, largest tensor bucket "
        f"{r['largest_bucket'] * mib:.0f} MiB, largest single read {r['largest_read'] * mib:.0f} "
        "MiB (embeddings and LM heads stream one saved chunk at a time)"
    )
    print(
        f"  RSS: baseline {r['baseline_kib'] / 1024:.0f} MiB, peak {r['peak_kib'] / 1024:.0f} MiB, "
        f"export adds {extra * mib:.0f} MiB = {extra / r['largest_bucket']:.2f} x largest bucket "
        f"= {extra / r['model_bytes']:.2f} x model (target < 1.5 x bucket: "
        f"{'met' if extra < target else 'MISSED'})"
    )
    print(f"  files in {work}")
    write_results(
        "convert",
        {
            "model": args.model,
            "tp": args.tp,
            "pp": args.pp,
            "dtype": args.dtype,
            "hf_to_mcore_s": to_mcore,
            "mcore_to_hf": r,
            "export_extra_rss_over_bucket": extra / r["largest_bucket"],
        },
        smoke=args.smoke,
        peak_size=256 if args.smoke else 2048,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
