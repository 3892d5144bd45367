"""Greedy generation of an exported HF folder in the CPU vLLM against transformers' ``generate``,
for the conversion tests: the folder must decode token for token as transformers decodes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

VLLM_SCRIPT = """
import json, os, sys
import torch
torch.set_num_threads(2)
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=64, enforce_eager=True, seed=0,
          skip_tokenizer_init=True)
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                    SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), detokenize=False))
print("TOKENS=" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def assert_vllm_generates_like_transformers(exported: Path, new: int = 12) -> None:
    """vLLM (fp32, greedy, in a subprocess) and transformers give the same ``new`` tokens."""
    from transformers import AutoModelForCausalLM

    prompts = [[1, 99, 28, 57, 314], [3, 504, 35, 282, 7, 7, 400]]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(exported), json.dumps(prompts), str(new)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS=")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    vllm_tokens = json.loads(lines[-1].removeprefix("TOKENS="))
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, vllm_tokens, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        assert got == ref[0, len(prompt) :].tolist()
