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


# ---- the step's rollout statistics at TP2 x DP2 == at one process ------------------------------

# each DP rank's share: (data source, score, scorer status, finish reason, response length) per
# sample; unequal sizes, sources spread unevenly (only DP0 holds "b", only DP1 holds "c")
_SHARES = [
    [
        ("a", 1.0, "ok", "stop", 3),
        ("a", 0.25, "ok", "length", 8),
        ("b", 0.0, "error", "stop", 2),
        ("a", 0.5, "ok", "stop", 5),
    ],
    [
        ("a", 0.75, "ok", "stop", 4),
        ("c", 2.0, "ok", "length", 8),
        ("c", 0.0, "timeout", "length", 8),
        ("c", 1.5, "ok", "stop", 1),
        ("c", -0.5, "ok", "stop", 6),
        ("a", 0.0, "error", "stop", 7),
    ],
]
_ROLLOUT_KEYS = (
    "reward/mean",
    "reward/std",
    "reward/samples",
    "reward/failures",
    "reward/timeouts",
    "reward/a/mean",
    "reward/a/count",
    "reward/b/mean",
    "reward/b/count",
    "reward/c/mean",
    "reward/c/count",
    "response/length_mean",
    "response/clip_ratio",
)


class _NoData:
    def metrics(self) -> dict[str, float]:
        return {}


def _step_batch(rows: list[tuple[str, float, str, str, int]]):
    """A StepBatch of ``rows`` with the reward manager's metrics of them."""
    import torch

    from megarl.rewards.manager import RewardManager, RewardSample
    from megarl.rewards.scoring import ScoreOutcome
    from megarl.trainer.batch import Samples, StepBatch

    samples = Samples.from_sequences(
        [[1, 2]] * len(rows), [[3] * r[4] for r in rows], list(range(len(rows))), 0, "cpu"
    )
    scores = torch.tensor([r[1] for r in rows])
    outcomes = [ScoreOutcome(i, r[2], r[1]) for i, r in enumerate(rows)]  # type: ignore[arg-type]
    reward = RewardManager._metrics([RewardSample(r[0], "", None) for r in rows], outcomes)
    return StepBatch(samples, scores, [r[3] for r in rows], reward)


def _rollout_worker(rank: int, world_size: int) -> dict[str, float]:
    from megarl import parallel
    from megarl.platform import adapt_megatron_for_cpu
    from megarl.trainer.step_metrics import rollout_metrics

    adapt_megatron_for_cpu()
    parallel.initialize_model_parallel(parallel.ParallelLayout.for_world(world_size, tp=2))
    try:
        batch = _step_batch(_SHARES[parallel.dp_rank()])
        return reduce_metrics(rollout_metrics(batch, _NoData()))
    finally:
        parallel.destroy_model_parallel()


def test_rollout_statistics_at_tp2_dp2_are_those_of_one_process():
    """reward/mean, std, the manager's counts and per-source means, length mean and clip ratio
    of unequal DP shares (TP replicas holding the same samples) are those of one process with
    all the samples: not each rank's statistic averaged, nor a count summed once per replica."""
    from megarl.trainer.step_metrics import rollout_metrics

    results = run_gloo(_rollout_worker, 4, timeout=180)
    assert all(r == results[0] for r in results)
    one = rollout_metrics(_step_batch(_SHARES[0] + _SHARES[1]), _NoData())  # no process group
    assert one["reward/samples"].value == 10.0 and one["reward/c/count"].value == 4.0
    for key in _ROLLOUT_KEYS:
        assert results[0][key] == pytest.approx(one[key].value, abs=1e-6), key
