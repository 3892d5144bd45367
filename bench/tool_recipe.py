"""The tool recipe's learning figures: what a run of configs/smollm2_calculator_cpu.yaml learnt.

    make learn-calculator                          # trains (outputs/learn_calculator/run)
    .venv/bin/python -m bench.tool_recipe          # reads that run, writes the figures

Reads the run's ``metrics.jsonl`` (and, with ``trainer.dump_rollouts=true``, its dumped
trajectories) and writes ``bench/results/learn_calculator.json``: the held-out curve (greedy
accuracy, tool calls and turns per problem at every validation) against steps and training
minutes (the sum of step times: start-up and validation excluded), the training signal per step
(reward, the share of correct answers among the trajectories that answered, tool calls and
failed calls per trajectory) and, from the last dumped step, its best-rewarded trajectory as
text. Prints the curve. Nothing is asserted: the figures are what the run measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "arithmetic"  # the recipe rows' data_source: validation metrics are named after it
STEP_KEYS = {
    "reward_mean": "reward/mean",
    "correct_among_answers": "reward/rule_mean",  # the scorer reads trajectories that answered
    "tool_calls_per_trajectory": "rollout/tool_calls_mean",
    "failed_calls": "rollout/tool_errors",
    "turns_mean": "rollout/turns_mean",
    "samples": "reward/samples",
}


def read_steps(run_dir: Path) -> dict[int, dict]:
    """The run's metrics by step (megarl.report's reader: a resumed step keeps its last value)."""
    from megarl.report import read_metrics

    series, _ = read_metrics(run_dir)
    steps: dict[int, dict] = {}
    for key, points in series.items():
        for step, value in points:
            steps.setdefault(step, {"step": step})[key] = value
    return steps


def curve(steps: dict[int, dict]) -> dict[str, list[dict]]:
    """The validation points and the per-step training signal of a run's metrics, by step."""
    minutes, clock = {0: 0.0}, 0.0
    train = []
    for step in sorted(s for s in steps if s > 0):
        m = steps[step]
        clock += float(m.get("timing/step_s", m.get("perf/step_s", 0.0)))
        minutes[step] = clock / 60
        if "reward/mean" in m:
            point = {"step": step, "minutes": round(minutes[step], 2)}
            point.update({k: m[v] for k, v in STEP_KEYS.items() if v in m})
            train.append(point)
    validation = []
    for step in sorted(steps):
        m = steps[step]
        key = f"val/{SOURCE}/pass@1"
        if key in m:
            validation.append(
                {
                    "step": step,
                    "minutes": round(minutes.get(step, float("nan")), 2),
                    "accuracy": m[key],
                    "problems": m.get(f"val/{SOURCE}/prompts"),
                    "tool_calls_per_problem": m.get("val/tool_calls_mean"),
                    "turns_per_problem": m.get("val/turns_mean"),
                }
            )
    return {"validation": validation, "train": train}


def best_trajectory(run_dir: Path, tokenizer_dir: Path) -> dict | None:
    """The last dumped step's best-rewarded trajectory, decoded."""
    dumps = sorted((run_dir / "rollouts").glob("step_*_dp0.jsonl"))
    if not dumps:
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    records = [json.loads(line) for line in dumps[-1].read_text().splitlines()]
    best = max(records, key=lambda r: sum(r["token_level_rewards"]))
    return {
        "step": int(dumps[-1].name.split("_")[1]),
        "reward": sum(best["token_level_rewards"]),
        "response": tok.decode(best["response_ids"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default=str(ROOT / "outputs/learn_calculator/run"))
    parser.add_argument("--model-dir", default=str(ROOT / "outputs/learn_calculator/model"))
    parser.add_argument("--config", default=str(ROOT / "configs/smollm2_calculator_cpu.yaml"))
    parser.add_argument("--name", default="learn_calculator")
    parser.add_argument("--command", default="make learn-calculator", help="recorded as is")
    parser.add_argument("--note", default="", help="recorded as is (the machine, the load...)")
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise SystemExit(f"no {run_dir}/metrics.jsonl: run `make learn-calculator` first")
    steps = read_steps(run_dir)
    points = curve(steps)
    print(f"{'step':>5} {'minutes':>8} {'accuracy':>9} {'calls/problem':>14} {'turns':>6}")
    for p in points["validation"]:
        calls, turns = p["tool_calls_per_problem"], p["turns_per_problem"]
        print(
            f"{p['step']:>5} {p['minutes']:>8.2f} {p['accuracy']:>9.3f} "
            f"{calls if calls is None else round(calls, 3):>14} "
            f"{turns if turns is None else round(turns, 3):>6}"
        )
    figures: dict[str, object] = dict(points)
    figures["best_trajectory_last_step"] = best_trajectory(run_dir, Path(args.model_dir))
    figures["command"] = args.command
    if args.note:
        figures["note"] = args.note
    figures["config"] = Path(args.config).read_text()  # the recipe as run (with --command)

    from bench.results_io import write_results

    write_results(args.name, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
