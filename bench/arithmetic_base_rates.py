"""How well does SmolLM2-135M-Instruct add before any training, and with which prompt? The base
rates behind the learning benchmark's task (bench/learn.py, configs/smollm2_arithmetic_cpu.yaml).

    .venv/bin/python -m bench.arithmetic_base_rates            # 48 problems a row, 8 samples
    .venv/bin/python -m bench.arithmetic_base_rates --smoke    # seconds: tiny model, 2 problems

Each row is a kind of problem and a way of asking (the question alone; with "Answer with the
number only."; after the recipe's two worked examples), played with megarl's vLLM engine greedily
(as validation scores) and with ``--samples`` samples at the row's temperature (as GRPO samples).
Reported per row: greedy accuracy, sampled accuracy, the share of problems whose samples are
neither all right nor all wrong (the groups GRPO learns from), and the mean answer length in
tokens. Scored as the recipe scores (megarl.rewards.arithmetic: the last number, exactly). Writes
bench/results/arithmetic_base_rates.json. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable
from typing import cast

from megarl.tools.data_prep.arithmetic import KINDS

_add2 = KINDS["add2"][0]  # the recipe's two-digit additions

NUMBER_ONLY = " Answer with the number only."


def _sum3(rng: random.Random) -> tuple[str, int]:
    a, b, c = (rng.randint(1, 20) for _ in range(3))
    return f"What is {a} + {b} + {c}?", a + b + c


def _mul1(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"What is {a} * {b}?", a * b


def _mul12(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 9), rng.randint(11, 29)
    return f"What is {a} * {b}?", a * b


# (task, generator, prompt: "plain" | "number-only" | "examples", sampling temperature)
ROWS: list[tuple[str, Callable[[random.Random], tuple[str, int]], str, float]] = [
    ("two-digit + two-digit", _add2, "plain", 1.0),
    ("three numbers of 1-20", _sum3, "plain", 1.0),
    ("two-digit + two-digit", _add2, "number-only", 0.7),
    ("one-digit x one-digit", _mul1, "number-only", 0.7),
    ("two-digit + two-digit", _add2, "examples", 1.0),
    ("one-digit x two-digit", _mul12, "examples", 1.0),
]


def messages(question: str, prompt: str) -> list[dict[str, str]]:
    from megarl.tools.data_prep.arithmetic import shot_messages

    if prompt == "number-only":
        return [{"role": "user", "content": question + NUMBER_ONLY}]
    shots = shot_messages("add2") if prompt == "examples" else []
    return [*shots, {"role": "user", "content": question}]


def measure(engine, tok, row, count: int, samples: int, max_tokens: int) -> dict[str, object]:
    from megarl.envs import ChatDeltas
    from megarl.rewards.arithmetic import compute_score
    from megarl.rollout.rollout_types import SamplingConfig

    task, make, prompt, temperature = row
    rng = random.Random(f"arithmetic-base-rates/{task}")
    problems = [make(rng) for _ in range(count)]
    chat = ChatDeltas(tok)
    ids = [chat.prompt_ids(messages(q, prompt)) for q, _ in problems]
    out: dict[str, object] = {"task": task, "prompt": prompt, "problems": count}
    for name, temp, n in (("greedy", 0.0, 1), ("sampled", temperature, samples)):
        t0 = time.perf_counter()
        res = engine.generate(
            ids, SamplingConfig(temperature=temp, n=n, max_new_tokens=max_tokens, seed=1)
        )
        texts = [tok.decode(t, skip_special_tokens=True) for t in res.token_ids]
        scores = [
            compute_score(text, problems[p][1])
            for p, text in zip(res.prompt_index, texts, strict=True)
        ]
        groups: dict[int, list[float]] = {}
        for p, s in zip(res.prompt_index, scores, strict=True):
            groups.setdefault(p, []).append(s)
        out[name] = {
            "temperature": temp,
            "samples": len(scores),
            "accuracy": sum(scores) / len(scores),
            "mixed_groups": sum(0 < sum(g) < len(g) for g in groups.values()) / len(groups),
            "answer_tokens": sum(len(t) for t in res.token_ids) / len(res.token_ids),
            "seconds": time.perf_counter() - t0,
            "example": f"{problems[0][0]} -> {texts[0][:160]!r}",
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=48)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 problems; CI")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import AutoTokenizer

    from bench.results_io import write_results
    from megarl.rollout.rollout_types import EngineConfig
    from megarl.rollout.vllm_rollout import VLLMRollout
    from megarl.tools.testing.assets import smollm2_dir, tiny_chat_llama_dir

    if args.smoke:
        args.problems, args.samples, args.max_tokens = 2, 2, 8
    torch.set_num_threads(args.threads)
    model_dir = str(tiny_chat_llama_dir() if args.smoke else smollm2_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMRollout(
        model_dir, 1, EngineConfig(max_model_len=512, kv_cache_bytes=512 << 20, max_num_seqs=256)
    )
    rows = []
    for row in ROWS:
        result = measure(engine, tok, row, args.problems, args.samples, args.max_tokens)
        rows.append(result)
        g, s = cast(dict, result["greedy"]), cast(dict, result["sampled"])
        print(
            f"[arithmetic_base_rates] {row[0]}, {row[2]}: greedy {g['accuracy']:.1%}, "
            f"sampled {s['accuracy']:.1%} at temperature {row[3]:g}, mixed groups "
            f"{s['mixed_groups']:.0%}, {s['answer_tokens']:.1f} answer tokens",
            flush=True,
        )
    write_results(
        "arithmetic_base_rates",
        {
            "model": "tiny-chat-llama" if args.smoke else "SmolLM2-135M-Instruct",
            "max_tokens": args.max_tokens,
            "rows": rows,
        },
        smoke=args.smoke,
        peak_size=256 if args.smoke else None,
    )


if __name__ == "__main__":
    main()
