"""Rollout throughput: megarl's vLLM engine (CPU build) vs HF transformers ``generate``.

    .venv/bin/python bench/rollout.py                      # SmolLM2-135M, 64 prompts x 128 tokens
    .venv/bin/python bench/rollout.py --prompts 16 --new-tokens 32

One process using all cores, fp32, the same sampling for both (temperature 0.8, top_p 0.95,
top_k 50, exactly ``--new-tokens`` tokens per response: EOS ignored so both produce the same
count), the same run. Prints tokens/s of each and the ratio (target >= 3). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.hybrid_engine.vllm_rollout import EngineConfig, SamplingConfig, VLLMRollout
    from megarl.testing.assets import smollm2_dir

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
        temperature=0.8, top_p=0.95, top_k=50, max_new_tokens=args.new_tokens, stop_token_ids=()
    )

    longest = max(len(p) for p in prompts) + args.new_tokens
    engine = VLLMRollout(
        model_dir, 1, EngineConfig(max_model_len=max(256, longest), kv_cache_bytes=1 << 30)
    )
    engine.generate(prompts[:2], SamplingConfig(max_new_tokens=4))  # warm-up
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    vllm_s = time.perf_counter() - t0
    vllm_tokens = sum(len(r) for r in out.token_ids)
    del engine

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=0.8,
            top_p=0.95,
            top_k=50,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            pad_token_id=pad,
        )
    hf_s = time.perf_counter() - t0
    hf_tokens = int((gen.shape[1] - width) * gen.shape[0])

    v, h = vllm_tokens / vllm_s, hf_tokens / hf_s
    print(
        f"SmolLM2-135M, {args.prompts} prompts x {args.new_tokens} new tokens, fp32, "
        f"{args.threads} threads"
    )
    print(
        f"  vLLM (CPU, megarl VLLMRollout): {vllm_tokens} tokens in {vllm_s:.1f} s = {v:.0f} tok/s"
    )
    print(f"  HF transformers generate:       {hf_tokens} tokens in {hf_s:.1f} s = {h:.0f} tok/s")
    print(f"  ratio vLLM / HF: {v / h:.2f} (target >= 3)")


if __name__ == "__main__":
    main()
