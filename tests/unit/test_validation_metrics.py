"""Validation metrics per data_source: mean@k, best@k, pass@k over k samples per prompt."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_validation_metrics_per_source():
    from megarl.trainer.validation import ValRecord, validation_metrics

    records = [
        ValRecord("gsm8k", 0, 1.0),
        ValRecord("gsm8k", 0, 0.0),
        ValRecord("gsm8k", 1, 0.0),
        ValRecord("gsm8k", 1, 0.0),
        ValRecord("toy", 7, 0.25),
        ValRecord("toy", 7, 0.75),
    ]
    m = validation_metrics(records, k=2, pass_score=1.0)
    assert m["val/gsm8k/mean@2"] == pytest.approx(0.25)
    assert m["val/gsm8k/best@2"] == pytest.approx(0.5)
    assert m["val/gsm8k/pass@2"] == pytest.approx(0.5)  # prompt 0 has a correct sample
    assert m["val/gsm8k/prompts"] == 2
    assert m["val/toy/mean@2"] == pytest.approx(0.5) and m["val/toy/pass@2"] == 0.0
    assert m["val/toy/best@2"] == pytest.approx(0.75)
    assert m["val/reward_mean"] == pytest.approx(2.0 / 6)
