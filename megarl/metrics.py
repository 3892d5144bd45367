"""Step metrics and how each one is reduced over ranks, declared where the metric is produced.

A producer states the reduction of every value it reports (:class:`Metric`, made with
:func:`mean`, :func:`total`, :func:`minimum`, :func:`maximum`, or :func:`declare` for a whole
dict of plain floats whose producer publishes the exceptions to the mean); :func:`reduce_metrics`
then applies it. What comes out, and what the trackers receive, is a plain ``dict[str, float]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class Reduce(StrEnum):
    """How a metric's per-rank values become one value of the step."""

    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


@dataclass(frozen=True)
class Metric:
    value: float
    reduce: Reduce = Reduce.MEAN


def mean(value: float) -> Metric:
    """Averaged over the ranks that report it."""
    return Metric(float(value), Reduce.MEAN)


def total(value: float) -> Metric:
    """Summed over the ranks that report it."""
    return Metric(float(value), Reduce.SUM)


def minimum(value: float) -> Metric:
    return Metric(float(value), Reduce.MIN)


def maximum(value: float) -> Metric:
    return Metric(float(value), Reduce.MAX)


StepMetrics = dict[str, Metric]


def declare(
    values: Mapping[str, float],
    reductions: Mapping[str, Reduce] | None = None,
    prefix: str = "",
) -> StepMetrics:
    """``values`` as metrics named ``prefix + key``: each one reduced as ``reductions`` (keyed
    without the prefix) says, the mean where it says nothing."""
    reductions = reductions or {}
    return {prefix + k: Metric(float(v), reductions.get(k, Reduce.MEAN)) for k, v in values.items()}


def reduce_metrics(metrics: Mapping[str, Metric]) -> dict[str, float]:
    """Each metric reduced over all ranks as it declares, the same dict on every rank (collective).

    Ranks may report different keys (losses exist on the last pipeline stage only): a rank's
    missing key counts as absent, not as zero; so do NaN and inf. A key no rank reports a finite
    value for comes out NaN.
    """
    import torch
    import torch.distributed as dist

    from megarl import platform

    for key, metric in metrics.items():
        if not isinstance(metric, Metric):
            raise TypeError(
                f"metric {key!r} is a {type(metric).__name__}; declare its reduction over ranks "
                "where it is produced (megarl.metrics.mean / total / minimum / maximum)"
            )
    mine = {k: m.reduce.value for k, m in metrics.items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    declared: dict[str, str] = {}
    for rank, names in enumerate(gathered):
        for key, how in names.items():
            if declared.setdefault(key, how) != how:
                raise ValueError(
                    f"metric {key!r} is reduced by {declared[key]} on one rank and by {how} on "
                    f"rank {rank}; declare one reduction for it"
                )
    keys = sorted(declared)
    values = torch.tensor(
        [metrics[k].value if k in metrics else float("nan") for k in keys],
        dtype=torch.float64,
        device=platform.collective_device(),
    )
    finite = torch.isfinite(values)
    summed = torch.where(finite, values, torch.zeros_like(values))
    counts = finite.double()
    maxed = torch.where(finite, values, torch.full_like(values, -float("inf")))
    mined = torch.where(finite, values, torch.full_like(values, float("inf")))
    dist.all_reduce(summed)
    dist.all_reduce(counts)
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
    dist.all_reduce(mined, op=dist.ReduceOp.MIN)
    nan = float("nan")
    out = {}
    for i, k in enumerate(keys):
        seen = counts[i] > 0
        out[k] = {
            Reduce.MEAN: float(summed[i] / counts[i]) if seen else nan,
            Reduce.SUM: float(summed[i]) if seen else nan,
            Reduce.MIN: float(mined[i]),
            Reduce.MAX: float(maxed[i]),
        }[Reduce(declared[k])]
    return out
