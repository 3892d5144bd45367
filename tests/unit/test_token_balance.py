"""DP token balance: groups stay whole, every rank gets as many groups, and the heaviest rank is
within mean + largest group (the bound the module guarantees); on long-tailed length
distributions it is within 3% of a lower bound on the best possible."""

from __future__ import annotations

import numpy as np
import pytest

from megarl.data.token_balance import balance_groups, imbalance

pytestmark = pytest.mark.unit


def _groups(rng: np.random.Generator, kind: str, groups: int, n: int) -> list[int]:
    """Tokens per group of ``n`` samples; prompt ~ 100 tokens, responses by ``kind``."""
    if kind == "lognormal":  # GSM8K-like long tail
        responses = rng.lognormal(mean=5.0, sigma=0.9, size=(groups, n))
    elif kind == "pareto":  # heavier tail
        responses = 20 * (1 + rng.pareto(1.5, size=(groups, n)))
    else:  # bimodal: most short, some hit the length cap
        responses = np.where(
            rng.random((groups, n)) < 0.15, 4096, rng.integers(10, 200, (groups, n))
        )
    responses = np.minimum(responses, 4096).astype(int)
    return [int(100 * n + r.sum()) for r in responses]


@pytest.mark.parametrize("kind", ["lognormal", "pareto", "bimodal"])
@pytest.mark.parametrize("ranks,groups", [(2, 16), (4, 64), (8, 128), (16, 256)])
def test_heaviest_rank_within_bound_and_groups_whole(kind, ranks, groups):
    rng = np.random.default_rng(ranks * 1000 + groups)
    tokens = _groups(rng, kind, groups, n=5)
    plan = balance_groups(tokens, ranks)
    assigned = sorted(i for rank in plan.ranks for i in rank)
    assert assigned == list(range(groups))  # each group exactly once: never split
    assert {len(rank) for rank in plan.ranks} == {groups // ranks}
    assert list(plan.tokens) == [sum(tokens[i] for i in rank) for rank in plan.ranks]
    mean = sum(tokens) / ranks
    assert max(plan.tokens) <= mean + max(tokens)  # the guaranteed bound
    # Measured on these distributions: within 3% of a lower bound on any equal-count assignment
    # (the mean, or the largest group plus the smallest others a rank must also take), and
    # never worse than cutting the batch into contiguous equal-count pieces.
    k = groups // ranks
    lower = max(mean, max(tokens) + sum(sorted(tokens)[: k - 1]))
    assert max(plan.tokens) <= 1.03 * lower, (max(plan.tokens), lower, mean)
    contiguous = [sum(tokens[r * k : (r + 1) * k]) for r in range(ranks)]
    assert plan.imbalance <= imbalance(contiguous)


def test_adversarial_lengths_still_meet_the_bound():
    # One huge group among small ones: the bound (mean + largest) is what can be promised.
    tokens = [10_000] + [10] * 7
    plan = balance_groups(tokens, 4)
    assert max(plan.tokens) <= sum(tokens) / 4 + max(tokens)
    assert max(plan.tokens) == 10_010  # the huge group plus one small one: optimal here


def test_imbalance_metric_and_errors():
    assert imbalance([100, 100, 100]) == 0.0
    assert imbalance([150, 50]) == pytest.approx(0.5)
    assert imbalance([0, 0]) == 0.0
    with pytest.raises(ValueError, match="multiple of the data-parallel size"):
        balance_groups([1, 2, 3], 2)
    assert balance_groups([5, 1, 4, 2], 1).ranks == ((0, 1, 2, 3),)


def test_step_reports_the_dp_token_imbalance_after_reduction():
    from megarl.run.steps import derived_metrics

    # After the reduction over ranks: max and mean of the ranks' trained tokens.
    assert derived_metrics({"perf/dp_tokens_max": 300.0, "perf/dp_tokens_mean": 300.0}) == {
        "perf/dp_token_imbalance": 0.0
    }
    two_ranks = {"perf/dp_tokens_max": 450.0, "perf/dp_tokens_mean": 300.0}  # ranks 450 and 150
    assert derived_metrics(two_ranks)["perf/dp_token_imbalance"] == pytest.approx(
        imbalance([450, 150])
    )
    assert derived_metrics({"reward/mean": 1.0}) == {}
