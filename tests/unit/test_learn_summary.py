"""bench/learn.py's summary (bench/learn_report.py): the time each side trains to reach the accuracy TRL ends with, their
ratio, and the seeds' means (the keys the README quotes), and the validation cadence both sides
share (bench/_validation_cadence.py). Hand-made curves, figures by hand."""

from __future__ import annotations

import pytest

from bench._validation_cadence import due, next_due, on_cadence
from bench.learn import TASKS
from bench.learn_report import overall_summary, summarize, time_to, time_to_trl_final_ratio

pytestmark = pytest.mark.unit


def curve(*points: tuple[float, float]) -> list[dict]:
    return [
        {"step": 3 * i, "clock_s": t, "score": a, "accuracy": a} for i, (t, a) in enumerate(points)
    ]


def side(points: list[dict]) -> dict:
    return {"curve": points, "step_s": [10.0, 30.0, 20.0]}


def test_time_to_is_the_first_validation_reaching_the_accuracy():
    c = curve((0, 0.4), (60, 0.55), (120, 0.7), (180, 0.65))
    assert time_to(c, 0.55) == 60 and time_to(c, 0.6) == 120 and time_to(c, 0.71) is None
    assert time_to(c, 0.3) == 0


def test_ratio_and_means_over_seeds():
    runs = {
        "1": {  # megarl reaches TRL's final 0.6 at 60 s, TRL at 240 s: ratio 0.25
            "runs": {
                "megarl": side(curve((0, 0.4), (60, 0.6), (120, 0.8))),
                "trl": side(curve((0, 0.4), (120, 0.5), (240, 0.6))),
            }
        },
        "2": {  # megarl never reaches TRL's 0.9: no ratio for this seed
            "runs": {
                "megarl": side(curve((0, 0.5), (100, 0.7))),
                "trl": side(curve((0, 0.5), (100, 0.9))),
            }
        },
    }
    for d in runs.values():
        d["summary"] = summarize(d["runs"])
    assert time_to_trl_final_ratio(runs["1"]["runs"]) == pytest.approx(0.25)
    assert time_to_trl_final_ratio(runs["2"]["runs"]) is None
    out = overall_summary(runs)
    assert out["megarl"]["accuracy_start"] == pytest.approx(0.45)
    assert out["megarl"]["accuracy_end"] == pytest.approx(0.75)
    assert out["trl"]["accuracy_end"] == pytest.approx(0.75) and out["trl"]["seeds"] == 2
    assert out["time_to_trl_final_ratio"] is None  # not reached in seed 2
    assert out["time_to_trl_final_ratio_per_seed"] == [pytest.approx(0.25), None]
    assert out["minutes_to_accuracy"]["0.6"] == {"megarl": [1.0, 100 / 60], "trl": [4.0, 100 / 60]}
    assert out["minutes_to_accuracy"]["0.7"]["megarl"] == [2.0, 100 / 60]
    del runs["2"]
    assert overall_summary(runs)["time_to_trl_final_ratio"] == pytest.approx(0.25)
    assert runs["1"]["summary"]["megarl"]["median_step_s"] == 20.0


def test_no_ratio_when_trl_did_not_improve_or_a_side_failed():
    flat = {"megarl": side(curve((0, 0.4), (60, 0.6))), "trl": side(curve((0, 0.4), (60, 0.4)))}
    assert time_to_trl_final_ratio(flat) is None
    failed = {"megarl": side(curve((0, 0.4))), "trl": {"failed": "exit 1: boom"}}
    assert time_to_trl_final_ratio(failed) is None
    assert set(overall_summary({"1": {"summary": summarize(failed), "runs": failed}})) == {
        "megarl",
        "time_to_trl_final_ratio",
        "time_to_trl_final_ratio_per_seed",
        "minutes_to_accuracy",
    }


def test_tasks_name_metrics_after_their_rows():
    assert TASKS["arithmetic"].val_accuracy == "val/arithmetic/pass@1"
    assert TASKS["gsm"].val_score == "val/openai/gsm8k/mean@1"
    for task in TASKS.values():
        assert task.config.is_file() and task.scorer_file.is_file()


def test_the_cadence_keeps_the_first_validation_past_each_due_time_and_the_budget():
    # a side validating every step (megarl): steps of 50 s, cadence 120 s, budget 400 s
    every_step = [{"step": i, "clock_s": 50.0 * i} for i in range(10)]
    kept = on_cadence(every_step, 120.0, 400.0)
    assert [p["clock_s"] for p in kept] == [0, 150, 250, 400]
    # a side with 130 s steps validates at each of its step ends, up to the one past the budget
    slow = [{"step": i, "clock_s": 130.0 * i} for i in range(6)]
    assert [p["step"] for p in on_cadence(slow, 120.0, 400.0)] == [0, 1, 2, 3, 4]
    # what the TRL worker decides step by step gives the same points
    due_s, picked = next_due(0.0, 120.0), [0.0]
    for p in every_step[1:]:
        if due(p["clock_s"], due_s, 400.0):
            picked.append(p["clock_s"])
            due_s = next_due(p["clock_s"], 120.0)
            if p["clock_s"] >= 400.0:
                break
    assert picked == [0, 150, 250, 400]
