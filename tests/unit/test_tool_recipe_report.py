"""bench/tool_recipe.py's reading of a run's metrics: validation points placed at the training
minutes (the sum of step times before them), the training signal per step, a run's last dumped
trajectory with the best reward."""

from __future__ import annotations

import json

import pytest

from bench.tool_recipe import best_trajectory, curve, read_steps
from tests.assets import qwen25_tokenizer_dir

pytestmark = pytest.mark.unit


def _records() -> list[dict]:
    val = {"val/arithmetic/prompts": 64.0, "val/turns_mean": 1.0, "val/tool_calls_mean": 0.0}
    out = [{"step": 0, "val/arithmetic/pass@1": 0.0, **val}]
    for step in (1, 2, 3, 4):
        out.append(
            {
                "step": step,
                "timing/step_s": 30.0 * step,
                "reward/mean": 0.1 * step,
                "reward/rule_mean": 0.05 * step,
                "rollout/tool_calls_mean": 0.25 * step,
                "rollout/tool_errors": 4.0 - step,
                "reward/samples": 16.0,
            }
        )
    # validation comes as a record of its own after the step's
    out.append({"step": 2, "val/arithmetic/pass@1": 0.5, **val, "val/tool_calls_mean": 1.0})
    out.append({"step": 4, "val/arithmetic/pass@1": 1.0, **val, "val/tool_calls_mean": 1.0})
    return out


def test_the_curve_places_validations_at_training_minutes(tmp_path):
    lines = [json.dumps(r) for r in _records()]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    figures = curve(read_steps(tmp_path))
    val = figures["validation"]
    assert [p["step"] for p in val] == [0, 2, 4]
    assert [p["accuracy"] for p in val] == [0.0, 0.5, 1.0]
    assert [p["minutes"] for p in val] == [0.0, 1.5, 5.0]  # (30 + 60) s, (30 + 60 + 90 + 120) s
    assert [p["tool_calls_per_problem"] for p in val] == [0.0, 1.0, 1.0]
    train = figures["train"]
    assert [p["step"] for p in train] == [1, 2, 3, 4]
    assert train[2]["correct_among_answers"] == pytest.approx(0.15)
    assert train[3]["failed_calls"] == 0.0 and train[0]["minutes"] == 0.5


def test_the_best_trajectory_of_the_last_dump(tmp_path):
    dumps = tmp_path / "rollouts"
    dumps.mkdir()
    for step, answers in ((1, ["no", "yes"]), (3, ["The answer is 5.", "six"])):
        rows = [
            {"response_ids": [ord(c) for c in a], "token_level_rewards": [0.0, 1.0 - k]}
            for k, a in enumerate(answers)
        ]
        (dumps / f"step_{step:06d}_dp0.jsonl").write_text(
            "\n".join(json.dumps(r) for r in rows) + "\n"
        )
    best = best_trajectory(tmp_path, qwen25_tokenizer_dir())
    assert best is not None and best["step"] == 3 and best["reward"] == 1.0
    assert best_trajectory(tmp_path / "nothing", qwen25_tokenizer_dir()) is None
