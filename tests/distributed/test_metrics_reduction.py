"""reduce_metrics over 3 gloo ranks: each metric is reduced as declared, whatever its name says."""

from __future__ import annotations

import pytest

from megarl.metrics import Metric, Reduce, maximum, mean, minimum, reduce_metrics, total
from tests.mp import run_gloo


def _reduce_worker(rank: int, world_size: int) -> dict[str, float]:
    v = float(rank + 1)  # 1, 2, 3
    metrics = {
        "a/mean": mean(v),
        "a/sum": total(v),
        "a/min": minimum(v),
        "a/max": maximum(v),
        "b/value_max": mean(v),  # named like a maximum, declared a mean
        "b/peak": maximum(v),  # a maximum without the name
        "b/nan_on_rank0": mean(float("nan") if rank == 0 else v),
    }
    if rank == 2:
        metrics["c/last_stage_only"] = mean(10.0)
    return reduce_metrics(metrics)


def _conflict_worker(rank: int, world_size: int) -> str:
    how = Reduce.MAX if rank == 0 else Reduce.MIN
    try:
        reduce_metrics({"x": Metric(1.0, how)})
    except ValueError as e:
        return str(e)
    return ""


def test_reduction_follows_the_declaration():
    results = run_gloo(_reduce_worker, 3, timeout=120)
    assert results[0] == results[1] == results[2]
    out = results[0]
    assert out["a/mean"] == pytest.approx(2.0)
    assert out["a/sum"] == pytest.approx(6.0)
    assert out["a/min"] == 1.0 and out["a/max"] == 3.0
    assert out["b/value_max"] == pytest.approx(2.0)
    assert out["b/peak"] == 3.0
    assert out["b/nan_on_rank0"] == pytest.approx(2.5)  # NaN counts as absent
    assert out["c/last_stage_only"] == 10.0  # absent keys are not zeros


def test_ranks_declaring_different_reductions_fail():
    messages = run_gloo(_conflict_worker, 2, timeout=120)
    assert all("declare one reduction" in m for m in messages)
