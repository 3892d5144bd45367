"""Declared metrics (megarl.metrics) without a process group; their reduction over ranks is
tested in tests/distributed/test_metrics_reduction.py."""

from __future__ import annotations

import math

import pytest

from megarl.metrics import Metric, Reduce, declare, reduce_metrics

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("value", [1.0, 2])
def test_declare_defaults_to_mean_and_names_exceptions(value):
    out = declare({"x_max": value, "y": value}, {"y": Reduce.MAX}, prefix="p/")
    assert out == {"p/x_max": Metric(float(value)), "p/y": Metric(float(value), Reduce.MAX)}
    assert not math.isnan(out["p/y"].value)


def test_undeclared_value_is_refused():
    with pytest.raises(TypeError, match="declare its reduction"):
        reduce_metrics({"x": 1.0})  # type: ignore[dict-item]
