"""The pipeline model of colocated vs asynchronous steps (megarl.plan.pipeline) against the
closed forms it must reduce to."""

from __future__ import annotations

import pytest

from megarl.plan.pipeline import (
    MeasuredScaling,
    PhaseTimes,
    best_split,
    predict_async,
    predict_colocated,
    simulate_async,
    split_table,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("gen", "train"), [(3.0, 2.0), (2.0, 3.0), (1.0, 1.0)])
def test_staleness_zero_is_serial_and_one_overlaps(gen, train):
    sync, load = 0.1, 0.05
    serial = simulate_async(gen, train, sync, load, 0, steps=30)
    assert serial.step_s(5) == pytest.approx(gen + load + train + sync)
    assert serial.versions == tuple(range(30))  # batch s from the weights after s steps
    overlapped = simulate_async(gen, train, sync, load, 1, steps=30)
    assert overlapped.step_s(5) == pytest.approx(max(gen + load, train + sync))
    assert overlapped.versions[1:] == tuple(range(29))  # one version behind
    assert overlapped.staleness_mean(5) == 1.0


def test_more_staleness_helps_only_with_uneven_steps_and_stays_bounded():
    # constant phases: one step of lag already hides the shorter phase
    one = simulate_async(3.0, 2.0, 0.0, 0.0, 1, steps=40).step_s(8)
    three = simulate_async(3.0, 2.0, 0.0, 0.0, 3, steps=40)
    assert three.step_s(8) == pytest.approx(one)
    assert all(0 <= s - v <= 3 for s, v in enumerate(three.versions))
    # a rollout-bound pipeline runs at the bound: the trainer waits, the rollout never does
    assert three.rollout_idle_s == pytest.approx(0.0)
    assert three.trainer_idle_s > 0


def test_colocated_is_the_sum_and_scaling_splits_the_work():
    measured = PhaseTimes(devices=4, generate_s=8.0, train_s=6.0, switch_s=1.0, tokens=4000)
    scaling = MeasuredScaling(measured)
    co = predict_colocated(scaling, 4, measured.switch_s)
    assert co.step_s == 15.0
    assert co.tokens_per_s(measured.tokens) == pytest.approx(4000 / 15)
    p = predict_async(scaling, 2, 2, 1, sync_s=0.5)
    assert (p.generate_s, p.train_s) == (16.0, 12.0)  # half the devices, twice the time each
    assert p.step_s == pytest.approx(16.0)
    sub = MeasuredScaling(measured, rollout_exponent=0.5)
    assert sub.generate_s(1) == pytest.approx(8.0 * 2.0)


def test_split_table_lists_the_valid_splits_and_the_best_one():
    measured = PhaseTimes(8, generate_s=10.0, train_s=4.0, switch_s=1.0)
    linear = MeasuredScaling(measured)
    rows = split_table(linear, 8, infer_tp=2, switch_s=1.0, sync_s=0.2, staleness=(1,))
    assert [(p.rollout_devices, p.trainer_devices) for p in rows] == [
        (0, 8),
        (2, 6),
        (4, 4),
        (6, 2),
    ]
    best = best_split(rows, 1)
    # generation dominates: most devices to the rollout group, but with the work split evenly
    # over devices no split beats colocated (15 s): the split is never exactly balanced
    assert (best.rollout_devices, best.trainer_devices) == (6, 2)
    assert best.step_s == pytest.approx(max(10.0 * 8 / 6, 4.0 * 4 + 0.2))
    assert best.step_s > rows[0].step_s
    # decoding that gains from more sequences per engine (time ~ devices^-0.5) makes 4 + 4 win
    decode_bound = MeasuredScaling(measured, rollout_exponent=0.5)
    rows = split_table(decode_bound, 8, infer_tp=2, switch_s=1.0, sync_s=0.2, staleness=(1,))
    best = best_split(rows, 1)
    assert (best.rollout_devices, best.trainer_devices) == (4, 4)
    assert best.step_s == pytest.approx(10.0 * 2**0.5)
    assert best.step_s < rows[0].step_s == 15.0
    assert best_split(rows, 0) is None
    odd = split_table(linear, 8, infer_tp=1, switch_s=1.0, sync_s=0.2, trainer_multiple=4)
    assert {p.trainer_devices for p in odd} == {8, 4}


def test_phase_times_from_a_runs_metrics():
    records = [
        {"timing/step_s": 99.0, "timing/rollout_s": 50.0},  # warm-up, skipped
        *(
            {
                "timing/step_s": 10.0 + i,
                "timing/rollout_s": 6.0,
                "reshard/seconds": 0.5,
                "timing/old_log_prob_s": 1.0,
                "perf/tokens_per_s": 100.0,
            }
            for i in range(3)
        ),
        {"val/reward_mean": 0.3},  # a validation record
    ]
    p = PhaseTimes.from_metrics(records, devices=2)
    assert p.generate_s == pytest.approx(6.0 - 0.5 - 1.0)
    assert p.switch_s == pytest.approx(0.5)
    assert p.train_s == pytest.approx(11.0 - 6.0 + 1.0)  # the median step
    assert p.tokens == pytest.approx(100.0 * 11.0)
    with pytest.raises(ValueError, match="no step records"):
        PhaseTimes.from_metrics(records[:1], devices=2)
    with pytest.raises(ValueError, match="max_staleness"):
        simulate_async(1.0, 1.0, 0.0, 0.0, -1)


def test_two_runs_fit_the_exponents_that_reproduce_both():
    wide = PhaseTimes(devices=4, generate_s=2.0, train_s=3.0, switch_s=0.1)
    # generation halves with twice the devices (exponent 1); training only gains 2**0.25
    narrow = PhaseTimes(devices=2, generate_s=4.0, train_s=3.0 * 2**0.25, switch_s=0.1)
    fit = MeasuredScaling.fitted(narrow, wide)  # either order
    assert fit.measured is wide
    assert fit.rollout_exponent == pytest.approx(1.0)
    assert fit.train_exponent == pytest.approx(0.25)
    assert fit.generate_s(2) == pytest.approx(4.0) and fit.train_s(2) == pytest.approx(
        narrow.train_s
    )
    assert fit.train_s(1) == pytest.approx(3.0 * 4**0.25)
    # a phase that got slower with more devices is clamped to "no gain", not a negative law
    slower = PhaseTimes(devices=2, generate_s=1.0, train_s=3.0, switch_s=0.1)
    assert MeasuredScaling.fitted(wide, slower).rollout_exponent == 0.0
    with pytest.raises(ValueError, match="different device counts"):
        MeasuredScaling.fitted(wide, wide)
