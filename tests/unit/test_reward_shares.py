"""How reward metrics of a batch scored in shares (one per DP rank) combine into the whole
batch's (megarl.rewards.shares): counts summed, means weighted by the count they are over, a std
pooled; what the table does not name is left out."""

from __future__ import annotations

import pytest
import torch

from megarl.rewards.shares import (
    COMBINED,
    ROLLOUT_SAMPLES,
    Count,
    Mean,
    Std,
    combination,
    combine_shares,
    pooled_std,
)

pytestmark = pytest.mark.unit


def _over_rollout(values: torch.Tensor) -> dict[str, float]:
    """A share's reward-model metrics as score_rollout reports them."""
    return {
        ROLLOUT_SAMPLES: float(values.numel()),
        "reward/model_mean": float(values.mean()),
        "reward/model_std": float(values.std()) if values.numel() > 1 else 0.0,
    }


def test_means_weigh_by_their_count_and_the_std_is_pooled():
    """Shares of 1, 3 and 8 samples (the one-sample share's std is 0) give the mean and std of
    all 12 samples, as one score of them reports; values far from 0 keep their std."""
    g = torch.Generator().manual_seed(0)
    values = 1e4 + torch.randn(12, generator=g, dtype=torch.float64)
    parts = [values[:1], values[1:4], values[4:]]
    combined = combine_shares([_over_rollout(p) for p in parts])
    whole = _over_rollout(values)
    assert combined == {k: pytest.approx(v, rel=1e-9) for k, v in whole.items()}


def test_counts_sum_and_the_scorers_means_weigh_by_their_own_samples():
    """The remote service and the judge count and average the samples they were asked about,
    the rule mean the manager's; a share without a key adds nothing to it."""
    shares = [
        {
            "reward/samples": 1.0,
            "reward/rule_mean": 1.0,
            "reward/remote_samples": 1.0,
            "reward/remote_mean": 4.0,
            "reward/remote_failures": 1.0,
            "reward/remote_retries": 2.0,
        },
        {
            "reward/samples": 3.0,
            "reward/rule_mean": 0.0,
            "reward/remote_samples": 3.0,
            "reward/remote_mean": 0.0,
            "reward/remote_failures": 0.0,
            "reward/remote_retries": 1.0,
            "reward/judge_samples": 2.0,
            "reward/judge_mean": 0.5,
            "reward/judge_unparsed": 1.0,
        },
    ]
    assert combine_shares(shares) == {
        "reward/judge_mean": 0.5,
        "reward/judge_samples": 2.0,
        "reward/judge_unparsed": 1.0,
        "reward/remote_failures": 1.0,
        "reward/remote_mean": 1.0,
        "reward/remote_retries": 3.0,
        "reward/remote_samples": 4.0,
        "reward/rule_mean": 0.25,
        "reward/samples": 4.0,
    }


def test_what_the_table_does_not_name_is_left_out():
    """reward/mean (the step's comes from the scores), a remote service's extra metric without
    its count, the multi-turn rollout/* (the step's on every rank), a data source's mean
    without its count, and a mean whose count no share holds."""
    shares = [
        {
            "reward/mean": 1.0,
            "reward/remote/vowels": 2.0,
            "rollout/turns_mean": 3.0,
            "reward/x/mean": 1.0,
            "reward/model_mean": 5.0,
        },
        {"reward/remote/vowels": 4.0, "reward/y/mean": 1.0, "reward/y/count": 2.0},
    ]
    assert combine_shares(shares) == {"reward/y/count": 2.0, "reward/y/mean": 1.0}
    assert combination("reward/remote/vowels", shares[0]) is None
    assert combination("reward/y/mean", shares[1]) == Mean("reward/y/count")
    assert combination("reward/y/count", shares[1]) == Count()


def test_a_remote_services_extra_metrics_weigh_by_the_samples_that_returned_them():
    """Rank 0's 1 sample returned "tests" (3.0), rank 1's 3 samples returned it (mean 1.0), so the
    whole batch's mean is 1.5, not the ranks' 2.0; a metric only one rank's samples returned is
    that rank's."""
    shares = [
        {"reward/remote/tests": 3.0, "reward/remote_samples/tests": 1.0},
        {
            "reward/remote/tests": 1.0,
            "reward/remote_samples/tests": 3.0,
            "reward/remote/ms": 40.0,
            "reward/remote_samples/ms": 2.0,
        },
    ]
    assert combine_shares(shares) == {
        "reward/remote/ms": 40.0,
        "reward/remote/tests": 1.5,
        "reward/remote_samples/ms": 2.0,
        "reward/remote_samples/tests": 4.0,
    }


def test_every_mean_and_std_is_over_a_declared_count():
    for key, how in COMBINED.items():
        if isinstance(how, Mean | Std):
            assert isinstance(COMBINED[how.over], Count), key
        if isinstance(how, Std):
            assert COMBINED[how.mean] == Mean(how.over), key


def test_pooled_std():
    assert pooled_std([]) == 0.0
    assert pooled_std([(1, 3.0, 0.0)]) == 0.0  # one value: no spread
    assert pooled_std([(1, 1.0, 0.0), (1, 3.0, 0.0)]) == pytest.approx(2**0.5)
    assert pooled_std([(0, 9.0, 0.0), (2, 1.0, 2.0)]) == pytest.approx(2**0.5)  # empty: nothing
