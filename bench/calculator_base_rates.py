"""Does SmolLM2-135M-Instruct use a calculator before any training? Base rates of the calculator
recipe (configs/smollm2_calculator_cpu.yaml), measured through megarl's own turn loop.

    .venv/bin/python -m bench.calculator_base_rates            # 32 problems, 8 samples, 0-2 examples
    .venv/bin/python -m bench.calculator_base_rates --smoke    # seconds: tiny model, 2 problems

For each number of worked examples in the prompt (0, 1, 2: a question, the calculator call, its
result, the answer) the recipe's ToolEnvironment (its system prompt, the calculator tool, the Hermes
call format) plays held-out three-digit additions with vLLM: sampled at temperature 1
(``--samples`` per problem, as GRPO samples) and greedy (as validation scores). Reported per
setting: the share of samples that try a tool call (a <tool_call> block), that call it well (every
call ran), that answer correctly, and correctly after a good call. Writes
bench/results/calculator_base_rates.json. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

EXAMPLE_TURNS = [
    ("What is 12 + 30?", "12 + 30", "42"),
    ("What is 7 * 15?", "7 * 15", "105"),
]


def examples(k: int) -> list[dict]:
    out = []
    for question, expression, value in EXAMPLE_TURNS[:k]:
        call = (
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
        )
        out += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": call % expression},
            {"role": "tool", "content": value},
            {"role": "assistant", "content": f"The answer is {value}."},
        ]
    return out


def measure(engine, tok, questions, k: int, temperature: float, n: int) -> dict:
    from megarl.envs import ChatDeltas, ToolEnvironment, ToolPool
    from megarl.envs.runner import EnvRunner
    from megarl.rewards.arithmetic import compute_score
    from megarl.rollout.multi_turn import TurnLimits, run_trajectories
    from megarl.rollout.rollout_split import SampleStart
    from megarl.rollout.rollout_types import SamplingConfig

    kwargs = {"tools": ["calculator"], "parser": "hermes", "examples": examples(k)}
    runner = EnvRunner(
        ToolEnvironment, kwargs, ChatDeltas(tok), ToolPool(8, 10), 0, [tok.eos_token_id], 1024
    )
    starts = [
        SampleStart(g * n + j, {"prompt": q}, [])
        for g, (q, _) in enumerate(questions)
        for j in range(n)
    ]
    t0 = time.perf_counter()
    trajs = run_trajectories(
        engine,
        starts,
        runner,
        SamplingConfig(temperature=temperature, n=n, seed=1),
        TurnLimits(max_turns=3, max_response_tokens=192, max_turn_tokens=64),
        rollout_index=0,
        pad_id=0,
    )
    seconds = time.perf_counter() - t0
    tried = [t.metrics.get("tool_calls", 0) > 0 for t in trajs]
    good = [a and t.metrics.get("tool_errors", 0) == 0 for a, t in zip(tried, trajs, strict=True)]
    right = [
        t.finish == "stop" and compute_score(t.final_text, questions[t.sample // n][1]) == 1.0
        for t in trajs
    ]
    count = max(len(trajs), 1)
    return {
        "examples": k,
        "temperature": temperature,
        "samples": len(trajs),
        "tried_call": sum(tried) / count,
        "good_call": sum(good) / count,
        "correct": sum(right) / count,
        "correct_after_good_call": sum(g and r for g, r in zip(good, right, strict=True)) / count,
        "seconds": seconds,
        "example": trajs[0].messages[-3:],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--examples", default="0,1,2")
    ap.add_argument("--task", default="add3", help="a kind of megarl.tools.data_prep.arithmetic")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 problems; CI")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import AutoTokenizer

    from bench.results_io import write_results
    from megarl.rollout.rollout_types import EngineConfig
    from megarl.rollout.vllm_rollout import VLLMRollout
    from megarl.tools.data_prep.arithmetic import problems
    from megarl.tools.testing.assets import smollm2_dir, tiny_chat_llama_dir

    if args.smoke:
        args.problems, args.samples, args.examples = 2, 2, "1"
    torch.set_num_threads(args.threads)
    model_dir = str(tiny_chat_llama_dir() if args.smoke else smollm2_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMRollout(
        model_dir, 1, EngineConfig(max_model_len=1024, kv_cache_bytes=512 << 20, max_num_seqs=256)
    )
    questions = problems(args.task, args.problems, seed=1)  # the recipe's held-out problems
    rows = []
    for k in (int(x) for x in args.examples.split(",")):
        for temperature, n in ((1.0, args.samples), (0.0, 1)):
            row = measure(engine, tok, questions, k, temperature, n)
            rows.append(row)
            print(
                f"[calculator_base_rates] {k} example(s), "
                f"{'greedy' if temperature == 0 else f'temperature {temperature:g}'}, "
                f"{row['samples']} samples: tried a call {row['tried_call']:.1%}, called well "
                f"{row['good_call']:.1%}, correct {row['correct']:.1%} "
                f"({row['correct_after_good_call']:.1%} after a good call), {row['seconds']:.0f} s",
                flush=True,
            )
    write_results(
        "calculator_base_rates" + ("" if args.task == "add3" else f"_{args.task}"),
        {
            "model": "tiny-chat-llama" if args.smoke else "SmolLM2-135M-Instruct",
            "problems": args.problems,
            "task": args.task,
            "rows": rows,
        },
        smoke=args.smoke,
        peak_size=256 if args.smoke else None,
    )


if __name__ == "__main__":
    main()
