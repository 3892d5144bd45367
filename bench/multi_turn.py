"""The cost of turn-level batching: a multi-turn rollout vs a single-turn one of the same tokens.

    .venv/bin/python -m bench.multi_turn                 # SmolLM2-135M: rollout + whole GRPO steps
    .venv/bin/python -m bench.multi_turn --no-steps      # the in-process rollout comparison only
    .venv/bin/python -m bench.multi_turn --smoke         # seconds: tiny model, rollout only

Both sides produce sequences of exactly the same length: the single-turn side samples
``turns x turn_tokens + (turns - 1) x env_tokens`` response tokens in one call (``ignore_eos``);
the multi-turn side runs megarl's turn loop (megarl.rollout.multi_turn) with an
environment (``FixedTurns`` below) that answers every model turn with the same short user
message until ``--turns`` model turns are done, each turn exactly ``--turn-tokens`` tokens
(ignore_eos). So the multi-turn side samples fewer tokens (the environment's are prefilled, not
decoded) but makes ``--turns`` engine calls, re-sending each trajectory's prefix (vLLM's prefix
cache holds it) and stepping the environments in between.

1. Rollout, in this process (vLLM, one engine, all cores): the median over ``--repeats`` of each
   side's seconds, and their ratio.
2. Whole GRPO steps (unless --no-steps): two ``megarl train`` runs on 1 process with the same
   model, prompts, samples and sequence lengths (one with ``rollout.env=bench/multi_turn.py:
   FixedTurns``); the median ``timing/step_s`` over the steps after the first, the phase
   breakdown (rollout, update, environment seconds), and the ratio.

Prints both and writes bench/results/multi_turn.json. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megarl.envs import Environment, Step

ROOT = Path(__file__).resolve().parents[1]
FOLLOW_UP = "Continue."


class FixedTurns(Environment):
    """The same user message after every model turn, until ``turns`` model turns are done."""

    def __init__(self, turns: int = 4):
        self.turns, self.seen = turns, 0

    def reset(self, row):
        prompt = row["prompt"]
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        return [{"role": "user", "content": text}]

    def step(self, messages):
        self.seen += 1
        if self.seen >= self.turns:
            return Step(reward=float(len(messages[-1]["content"]) % 7) / 7, done=True)
        return Step(messages=[{"role": "user", "content": FOLLOW_UP}], reward=0.0)


def env_tokens(tokenizer) -> int:
    """Tokens the template adds after a cut model turn for the follow-up message."""
    from megarl.envs import ChatDeltas

    return len(ChatDeltas(tokenizer).env_ids([{"role": "user", "content": FOLLOW_UP}], None))


def log(msg: str) -> None:
    print(f"[multi_turn] {msg}", flush=True)


def rollout_comparison(args, model_dir: str) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import AutoTokenizer

    from megarl.envs import ChatDeltas, ToolPool
    from megarl.envs.runner import EnvRunner
    from megarl.rollout.multi_turn import TurnLimits, run_trajectories
    from megarl.rollout.rollout_split import SampleStart
    from megarl.rollout.rollout_types import EngineConfig, SamplingConfig
    from megarl.rollout.vllm_rollout import VLLMRollout

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    env = env_tokens(tok)
    length = args.turns * args.turn_tokens + (args.turns - 1) * env
    questions = [f"Tell me about topic {i}." for i in range(args.prompts)]
    engine = VLLMRollout(
        model_dir,
        1,
        EngineConfig(max_model_len=length + 64, kv_cache_bytes=512 << 20, max_num_seqs=256),
    )
    single = SamplingConfig(
        temperature=1.0, n=args.n, max_new_tokens=length, ignore_eos=True, stop_token_ids=()
    )
    turn = SamplingConfig(temperature=1.0, n=args.n, ignore_eos=True, stop_token_ids=())
    deltas = ChatDeltas(tok)
    prompts = [deltas.prompt_ids([{"role": "user", "content": q}]) for q in questions]
    limits = TurnLimits(args.turns, length, args.turn_tokens)

    def run_single() -> int:
        out = engine.generate(prompts, single)
        return sum(
            len(p) + len(r)
            for p, r in zip([prompts[i] for i in out.prompt_index], out.token_ids, strict=True)
        )

    def run_multi(seed: int) -> tuple[int, float]:
        runner = EnvRunner(
            FixedTurns, {"turns": args.turns}, deltas, ToolPool(8, 30), 0, [], 1 << 20
        )
        starts = [
            SampleStart(g * args.n + j, {"prompt": q}, [])
            for g, q in enumerate(questions)
            for j in range(args.n)
        ]
        trajs = run_trajectories(
            engine,
            starts,
            runner,
            turn,
            limits,
            rollout_index=seed,
            pad_id=0,
        )
        assert all(t.turns == args.turns and len(t.response_ids) == length for t in trajs)
        return sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs), runner.take_seconds()

    run_single()  # warm-up
    run_multi(99)
    times: dict[str, list[float]] = {"single": [], "multi": [], "env": []}
    tokens = {}
    for r in range(args.repeats):
        t0 = time.perf_counter()
        tokens["single"] = run_single()
        times["single"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tokens["multi"], env_s = run_multi(r)
        times["multi"].append(time.perf_counter() - t0)
        times["env"].append(env_s)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "sequence_length": length,
        "env_tokens_per_turn": env,
        "tokens_single": tokens["single"],
        "tokens_multi": tokens["multi"],
        "single_turn_s": med["single"],
        "multi_turn_s": med["multi"],
        "multi_turn_env_s": med["env"],
        "rollout_ratio_multi_over_single": med["multi"] / med["single"],
        "repeats": args.repeats,
    }
    log(
        f"rollout of {args.prompts} prompts x {args.n} samples, sequences of {length} tokens "
        f"(prompt excluded), {args.turns} turns x {args.turn_tokens} tokens + {env}-token "
        f"environment turns: single-turn {med['single']:.2f} s, multi-turn {med['multi']:.2f} s "
        f"(environments {med['env']:.3f} s) -> ratio {out['rollout_ratio_multi_over_single']:.2f}"
    )
    return out


def _config(args, work: Path, model_dir: str, length: int, multi: bool) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = work / "prompts.parquet"
    if not data.exists():
        rows = [
            {
                "prompt": [{"role": "user", "content": f"Tell me about topic {i}."}],
                "data_source": "bench",
                "reward_model": {"ground_truth": "0"},
            }
            for i in range(64)
        ]
        pq.write_table(pa.Table.from_pylist(rows), data)
    over = [
        f"model.path={model_dir}",
        f"data.train_files=[{data}]",
        f"data.train_batch_size={args.prompts}",
        "data.max_prompt_length=128",
        "data.shuffle=false",
        f"rollout.sampling.n={args.n}",
        f"rollout.sampling.max_response_length={length}",
        "rollout.sampling.ignore_eos=true",
        "rollout.engine.kv_cache_gib=1",
        f"actor.ppo_mini_batch_size={args.prompts}",
        "actor.micro_batch_size=8",
        "algorithm.use_kl_loss=false",
        "reward.custom_fn=megarl.rewards.toy:vowel_rate",
        f"trainer.total_steps={args.steps}",
        "trainer.loggers=[console]",
        "trainer.mlflow_tracking_uri=none",
        f"trainer.output_dir={work / ('multi' if multi else 'single')}",
    ]
    if multi:
        over += [
            f"rollout.env={Path(__file__).resolve()}:FixedTurns",
            f"rollout.env_kwargs.turns={args.turns}",
            f"rollout.environment.max_turns={args.turns}",
            f"rollout.environment.max_turn_tokens={args.turn_tokens}",
        ]
    return over


def step_comparison(args, model_dir: str, length: int) -> dict:
    out = {}
    with tempfile.TemporaryDirectory(prefix="megarl-bench-mt-") as tmp:
        work = Path(tmp)
        for side in ("single", "multi"):
            cmd = [
                sys.executable,
                "-m",
                "megarl.cli",
                "train",
                *_config(args, work, model_dir, length, side == "multi"),
                "--nproc-per-node",
                "1",
            ]
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            env.pop("MASTER_PORT", None)
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)
            if proc.returncode != 0:
                raise SystemExit(f"{side} run failed:\n{proc.stderr[-3000:]}")
            steps = [
                json.loads(line)
                for line in (work / side / "metrics.jsonl").read_text().splitlines()
            ]
            later = [s for s in steps if s["step"] > 1] or steps
            keys = (
                "timing/step_s",
                "timing/rollout_s",
                "timing/update_actor_s",
                "timing/experience_s",
                "rollout/tool_s",
                "perf/dp_tokens_mean",
            )
            out[side] = {k: statistics.median(s[k] for s in later) for k in keys if k in later[0]}
            log(
                f"{side}-turn GRPO step: " + ", ".join(f"{k} {v:.3f}" for k, v in out[side].items())
            )
    out["step_ratio_multi_over_single"] = (
        out["multi"]["timing/step_s"] / out["single"]["timing/step_s"]
    )
    log(f"step time ratio multi-turn / single-turn: {out['step_ratio_multi_over_single']:.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-steps", action="store_true", help="the rollout comparison only")
    ap.add_argument("--smoke", action="store_true", help="tiny model, rollout only; CI")
    args = ap.parse_args()
    from bench.results_io import write_results
    from megarl.tools.testing.assets import smollm2_dir, tiny_chat_llama_dir

    if args.smoke:
        args.prompts, args.n, args.turns, args.turn_tokens, args.repeats = 2, 2, 2, 4, 1
    model_dir = str(tiny_chat_llama_dir() if args.smoke else smollm2_dir())
    figures = {
        "model": "tiny-chat-llama" if args.smoke else "SmolLM2-135M-Instruct",
        "prompts": args.prompts,
        "samples_per_prompt": args.n,
        "turns": args.turns,
        "turn_tokens": args.turn_tokens,
        "threads": args.threads,
        "rollout": rollout_comparison(args, model_dir),
    }
    if not (args.no_steps or args.smoke):
        figures["steps"] = step_comparison(args, model_dir, figures["rollout"]["sequence_length"])
    write_results("multi_turn", figures, smoke=args.smoke, peak_size=256 if args.smoke else None)


if __name__ == "__main__":
    main()
