"""The asynchronous weight broadcast's plan, without processes: every slice of every tensor goes
out exactly once, from a trainer that holds it, the DP replicas sharing the sending; buckets keep
groups whole and within their bound."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from megarl.parallel import ParallelLayout
from megarl.rollout.async_links import weight_schedule
from megarl.weights.broadcast_schedule import schedule_broadcast
from megarl.weights.tensor_list import actor_planned_tensors
from tests.unit.test_reshard_schedule import DIMS, TIED

LAYOUTS = [(tp, pp, dp) for tp in (1, 2, 4) for pp in (1, 2, 4) for dp in (1, 2, 3)]


def _holds(tp: int, dp: int, spec, rank: int, start: int, stop: int, ep: int = 1) -> bool:
    t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    if p != spec.stage or (spec.expert_rank is not None and d % ep != spec.expert_rank):
        return False
    if spec.tp_dim is None:
        return True
    step = spec.shape[spec.tp_dim] // tp
    return t * step <= start and stop <= (t + 1) * step


@pytest.mark.parametrize(("tp", "pp", "dp"), LAYOUTS)
def test_each_slice_once_from_a_holder(tp, pp, dp):
    specs = actor_planned_tensors(DIMS, [DIMS.num_layers // pp] * pp, 4)
    plan = schedule_broadcast(specs, tp, pp, dp, bucket_bytes=48_000)
    covered = defaultdict(list)
    for members, bucket in zip(plan.buckets, plan.ops, strict=True):
        keys = {specs[t].key for t in members}
        if len(keys) > 1:  # a bucket of several groups stays within the bound
            assert sum(specs[t].nbytes for t in members) <= plan.bucket_bytes
        for op in bucket:
            spec = specs[op.slice.tensor]
            assert op.slice.tensor in members
            assert _holds(tp, dp, spec, op.src, op.slice.start, op.slice.stop), op
            assert op.nbytes == (op.slice.stop - op.slice.start) * spec.row_bytes()
            covered[op.slice.tensor].append((op.slice.start, op.slice.stop))
    for t, spec in enumerate(specs):  # the whole tensor, once
        extent = 1 if spec.tp_dim is None else spec.shape[spec.tp_dim]
        ranges = sorted(covered[t])
        assert ranges[0][0] == 0 and ranges[-1][1] == extent
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    groups = [t for b in plan.buckets for t in b]
    assert groups == list(range(len(specs)))  # every spec in one bucket, in order
    assert plan.recv_bytes() == sum(s.nbytes for s in specs)
    assert sum(plan.send_bytes(r) for r in range(tp * pp * dp)) == plan.recv_bytes()
    if dp > 1:  # the replicas take turns: each one sends something
        replicas = {(r // tp) % dp for r in plan.sources()}
        assert replicas == set(range(dp))


def test_the_plan_of_a_run_and_its_refusals():
    plan = weight_schedule(TIED, ParallelLayout(tp=2, pp=2, dp=2), itemsize=2)
    assert plan.specs[0].itemsize == 2 and plan.peak_bucket_bytes() <= plan.recv_bytes()
    assert "lm_head.weight" not in {s.name for s in plan.specs}  # tied: the embedding serves
    assert plan.sources() == sorted(plan.sources()) and len(plan.sources()) <= 8
    specs = actor_planned_tensors(DIMS, [DIMS.num_layers], 4)
    with pytest.raises(ValueError, match="bucket_bytes"):
        schedule_broadcast(specs, 1, 1, 1, bucket_bytes=0)
    with pytest.raises(ValueError, match="ep=3 must divide dp=2"):
        schedule_broadcast(specs, 1, 1, 2, bucket_bytes=1 << 20, ep=3)
    with pytest.raises(ValueError, match="does not split"):
        schedule_broadcast(specs, 3, 1, 1, bucket_bytes=1 << 20)
