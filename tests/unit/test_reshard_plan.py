"""The reshard planner, without processes: delivery exactly once, bucket bounds, matched ops."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict

import pytest

from megarl.hybrid_engine.reshard_plan import need_range, plan_reshard
from megarl.hybrid_engine.tensor_list import actor_tensor_specs
from megarl.models.dims import ModelDims

DIMS = ModelDims(
    family="qwen2",
    architecture="Qwen2ForCausalLM",
    hidden_size=64,
    num_layers=4,
    num_attention_heads=8,
    num_kv_heads=4,
    head_dim=8,
    ffn_hidden_size=128,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    qkv_bias=True,
)
TIED = ModelDims(**{**DIMS.__dict__, "tie_word_embeddings": True, "qkv_bias": False})

LAYOUTS = [(tp, pp, 16 // (tp * pp)) for tp in (1, 2, 4) for pp in (1, 2, 4)]


def _holders(plan, spec, rank):
    """Ranges along tp_dim that ``rank`` holds of ``spec`` in the training layout."""
    t, p = rank % plan.tp, rank // (plan.tp * plan.dp)
    if p != spec.stage:
        return None
    if spec.tp_dim is None:
        return (0, 1)
    step = spec.shape[spec.tp_dim] // plan.tp
    return (t * step, (t + 1) * step)


def _check(plan):
    world = plan.world_size
    specs = plan.specs
    delivered = defaultdict(list)  # (rank, tensor) -> ranges
    for r in range(world):
        assert len(plan.for_rank(r)) == len(plan.buckets)
        for rb in plan.for_rank(r):
            # bucket bound: a bucket is within bucket_bytes unless it holds a single group
            members = plan.buckets[rb.index]
            if len({specs[i].key for i in members}) > 1:
                assert rb.dest_bytes(specs) <= plan.bucket_bytes
            assert set(rb.needs) == set(members)
            for op in rb.ops:
                spec = specs[op.slice.tensor]
                assert op.slice.tensor in members
                assert op.nbytes == (op.slice.stop - op.slice.start) * spec.row_bytes()
                if op.kind in ("copy", "recv"):
                    delivered[r, op.slice.tensor].append((op.slice.start, op.slice.stop))
                if op.kind in ("copy", "send"):  # the source holds what it gives
                    held = _holders(plan, spec, r)
                    assert held is not None
                    assert held[0] <= op.slice.start and op.slice.stop <= held[1]
                if op.kind == "copy":
                    assert op.peer == r
    # every byte each rank needs, exactly once
    for r, (t, spec) in itertools.product(range(world), enumerate(specs)):
        lo, hi = need_range(spec, plan, r)
        got = sorted(delivered.get((r, t), []))
        cursor = lo
        for a, b in got:
            assert a == cursor, (r, spec.name, got)
            cursor = b
        assert cursor == hi, (r, spec.name, got)
    # each send has its receive, same bucket, same order between each pair of ranks
    for b in range(len(plan.buckets)):
        for src, dst in itertools.product(range(world), repeat=2):
            sends = [
                (op.slice, op.nbytes)
                for op in plan.for_rank(src)[b].ops
                if op.kind == "send" and op.peer == dst
            ]
            recvs = [
                (op.slice, op.nbytes)
                for op in plan.for_rank(dst)[b].ops
                if op.kind == "recv" and op.peer == src
            ]
            assert sends == recvs
    for r in range(world):
        assert plan.recv_bytes(r) == plan.min_recv_bytes(r)


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
@pytest.mark.parametrize("infer_tp", [1, 2, 4])
@pytest.mark.parametrize("mode", ["full", "shard"])
def test_plan_delivers_every_byte_once(tp, pp, dp, infer_tp, mode):
    specs = actor_tensor_specs(DIMS, [DIMS.num_layers // pp] * pp)
    plan = plan_reshard(specs, tp, pp, dp, infer_tp, bucket_bytes=40_000, mode=mode)
    _check(plan)
    assert len(plan.buckets) > 3


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 4), (4, 1)])
def test_plan_world_of_four_and_tied_model(tp, pp):
    specs = actor_tensor_specs(TIED, [TIED.num_layers // pp] * pp)
    assert not any(s.name.startswith("output_layer") for s in specs)
    for infer_tp in (1, 2, 4):
        plan = plan_reshard(specs, tp, pp, 4 // (tp * pp), infer_tp, bucket_bytes=1 << 16)
        _check(plan)


def test_buckets_respect_size_and_oversized_tensor_travels_alone():
    specs = actor_tensor_specs(DIMS, [2, 2])
    embed = specs[0].nbytes  # 512 x 64 x 4 bytes = 131072
    plan = plan_reshard(specs, 2, 2, 1, 2, bucket_bytes=embed // 4)
    _check(plan)
    first = plan.buckets[0]
    assert [plan.specs[i].name for i in first] == ["embedding.word_embeddings.weight"]
    for r in range(4):
        assert plan.peak_dest_bytes(r) == embed  # the one oversized tensor
    big = plan_reshard(specs, 2, 2, 1, 2, bucket_bytes=1 << 40)
    assert len(big.buckets) == 1


def test_modules_stay_in_one_bucket():
    specs = actor_tensor_specs(DIMS, [4])
    plan = plan_reshard(specs, 2, 1, 1, 1, bucket_bytes=1)  # every group alone
    for members in plan.buckets:
        names = [plan.specs[i].name for i in members]
        assert len({plan.specs[i].key for i in members}) == 1
        if "linear_fc1" in names[0]:
            assert [n[-2:] for n in names] == ["#0", "#1"]
        if "linear_qkv" in names[0]:  # weight and bias together
            assert [n.rsplit(".", 1)[1] for n in names] == ["weight", "bias"]


def test_plan_is_deterministic_and_exact_minimum():
    specs = actor_tensor_specs(DIMS, [2, 2])
    a = plan_reshard(specs, 2, 2, 2, 2, bucket_bytes=50_000, mode="shard")
    b = plan_reshard(list(specs), 2, 2, 2, 2, bucket_bytes=50_000, mode="shard")
    assert a == b
    # zero-redundancy (shard mode) moves less than full mode, and a rank whose inference shard is
    # already local for a tensor receives nothing for it
    full = plan_reshard(specs, 2, 2, 2, 2, bucket_bytes=50_000)
    assert all(a.recv_bytes(r) < full.recv_bytes(r) for r in range(8))
    # senders are spread over DP replicas
    senders = Counter(op.peer for rb in full.for_rank(0) for op in rb.ops if op.kind == "recv")
    assert len(senders) > 2


def test_plan_rejects_bad_inputs():
    specs = actor_tensor_specs(DIMS, [4])
    with pytest.raises(ValueError, match="does not divide the world size"):
        plan_reshard(specs, 2, 1, 1, 4, bucket_bytes=10)
    with pytest.raises(ValueError, match=r"embedding\.word_embeddings\.weight.*tp=3"):
        plan_reshard(specs, 3, 1, 1, 1, bucket_bytes=10)
    with pytest.raises(ValueError, match="do not sum"):
        actor_tensor_specs(DIMS, [1, 1])
