"""`megarl plan` with mixture-of-experts models: expert parallelism in the parameter counts, the
optimizer's expert-DP sharding, active-parameter FLOPs, the all-to-all term and the search."""

from __future__ import annotations

import pytest

from megarl.parallel import ParallelLayout
from megarl.plan.cost import step_time
from megarl.plan.hardware import Cluster
from megarl.plan.known_models import resolve_model
from megarl.plan.memory import GPU_BF16, Options, estimate_memory
from megarl.plan.params import flops_params, stage_params
from megarl.plan.report import to_json
from megarl.plan.search import Filters, search
from megarl.plan.units import GIB
from megarl.plan.workload import Workload

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def a3b():
    return resolve_model("Qwen3-30B-A3B")[1]


def test_active_parameters_and_expert_split(a3b):
    # published: 30.5B total, 3.3B activated (embeddings counted once, as the output projection)
    active = flops_params(a3b) + a3b.vocab_size * a3b.hidden_size
    assert 3.2e9 < active < 3.45e9
    whole = stage_params(a3b, 1, 1, 0, a3b.num_layers)
    ep8 = stage_params(a3b, 1, 1, 0, a3b.num_layers, ep=8)
    assert 28.5e9 < whole.experts < 29.5e9  # 48 layers x 128 experts x 3 x 2048 x 768
    assert ep8.experts * 8 == whole.experts
    assert whole.total - whole.experts == ep8.total - ep8.experts  # the rest is not split by EP


def test_expert_optimizer_state_shards_over_expert_dp(a3b):
    work = Workload(seq_len=1024, micro_batch=1, global_batch=64)
    opts = Options(optimizer_offload=False)
    ep1 = estimate_memory(a3b, ParallelLayout(pp=4, dp=2), work, GPU_BF16, opts, 141 * GIB)
    ep2 = estimate_memory(a3b, ParallelLayout(pp=4, dp=2, ep=2), work, GPU_BF16, opts, 141 * GIB)
    # EP2 holds half the experts but shards their Adam state over expert-DP 1 instead of DP 2:
    # the optimizer state per rank is the same; weights and grads halve for the experts.
    a, b = (m.stages[0].phase_items["forward-backward"] for m in (ep1, ep2))
    assert b["optimizer"] == pytest.approx(a["optimizer"], rel=0.01)
    assert b["grads"] < 0.6 * a["grads"] and b["weights"] < 0.6 * a["weights"]


def test_all_to_all_only_with_ep(a3b):
    cluster = Cluster(gpus=8, gpu_memory=80 * GIB)
    work = Workload(seq_len=4096, micro_batch=1, global_batch=256)
    t1 = step_time(a3b, ParallelLayout(dp=8), work, Options(), cluster, GPU_BF16)
    t8 = step_time(a3b, ParallelLayout(dp=8, ep=8), work, Options(), cluster, GPU_BF16)
    assert t1.parts["ep_comm"] == 0.0 < t8.parts["ep_comm"]
    assert t8.parts["compute"] == t1.parts["compute"]


def test_search_tries_expert_parallel_layouts(a3b):
    cluster = Cluster(gpus=8, gpu_memory=80 * GIB)
    work = Workload(seq_len=4096, micro_batch=1, global_batch=256)
    result = search("Qwen3-30B-A3B", a3b, cluster, work)
    eps = {e.layout.ep for e in result.feasible}
    assert {1, 2, 8} <= eps, eps
    out = to_json(result)
    assert out["model"]["num_experts"] == 128
    with_ep = [e for e in out["feasible"] if e["ep"] > 1]
    assert with_ep and all(f"parallel.ep={e['ep']}" in e["overrides"] for e in with_ep)
    only = search("Qwen3-30B-A3B", a3b, cluster, work, filters=Filters(ep=8))
    assert {e.layout.ep for e in only.feasible} == {8}


def test_ep_on_a_dense_model_is_rejected_by_the_planner():
    _, dims = resolve_model("Qwen3-8B")
    result = search(
        "Qwen3-8B", dims, Cluster(gpus=8, gpu_memory=80 * GIB), Workload(), filters=Filters(ep=2)
    )
    assert not result.feasible
    assert any("needs a mixture-of-experts model" in r.reason for r in result.rejected)
