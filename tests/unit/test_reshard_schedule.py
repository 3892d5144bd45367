"""The reshard planner, without processes: delivery exactly once, bucket bounds, matched ops; shard
mode cut as vLLM cuts each tensor (padded vocabulary, query groups with replicated KV heads,
experts); its byte figures at Qwen2.5-72B scale against hand-computed ones."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import replace

import pytest
import torch

from megarl.models.dims import ModelDims
from megarl.models.hf_map import fuse_qkv, split_qkv_shard
from megarl.plan.known_models import resolve_model
from megarl.weights.reshard_schedule import need_ranges, reshard_traffic, schedule_reshard
from megarl.weights.tensor_list import actor_planned_tensors

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
        got = sorted(delivered.get((r, t), []))
        want = []
        for lo, hi in need_ranges(spec, plan, r):
            pieces = [(a, b) for a, b in got if lo <= a and b <= hi]
            cursor = lo
            for a, b in pieces:
                assert a == cursor, (r, spec.name, got)
                cursor = b
            assert cursor == hi, (r, spec.name, got)
            want += pieces
        assert sorted(want) == got, (r, spec.name, got)
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
@pytest.mark.parametrize("infer_tp", [1, 2, 4, 8])  # 8 > 4 KV heads: each pair shares a group
@pytest.mark.parametrize("mode", ["full", "shard"])
def test_plan_delivers_every_byte_once(tp, pp, dp, infer_tp, mode):
    specs = actor_planned_tensors(DIMS, [DIMS.num_layers // pp] * pp)
    plan = schedule_reshard(specs, tp, pp, dp, infer_tp, bucket_bytes=40_000, mode=mode)
    _check(plan)
    assert len(plan.buckets) > 3
    # the fast byte count is the plan's, rank by rank (ranks_per_node: 4 ranks a node)
    nodes = schedule_reshard(specs, tp, pp, dp, infer_tp, 1 << 30, mode=mode, ranks_per_node=4)
    traffic = reshard_traffic(specs, tp, pp, dp, infer_tp, mode=mode, ranks_per_node=4)
    for r, rt in enumerate(traffic):
        assert rt.recv == nodes.recv_bytes(r) == plan.recv_bytes(r) == rt.minimum
        assert rt.need == plan.need_bytes(r)
        assert rt.cross_node == nodes.cross_node_recv_bytes(r, 4)


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 4), (4, 1)])
def test_plan_world_of_four_and_tied_model(tp, pp):
    specs = actor_planned_tensors(TIED, [TIED.num_layers // pp] * pp)
    assert not any(s.name.startswith("output_layer") for s in specs)
    for infer_tp in (1, 2, 4):
        plan = schedule_reshard(specs, tp, pp, 4 // (tp * pp), infer_tp, bucket_bytes=1 << 16)
        _check(plan)


def test_buckets_respect_size_and_oversized_tensor_travels_alone():
    specs = actor_planned_tensors(DIMS, [2, 2])
    embed = specs[0].nbytes  # 512 x 64 x 4 bytes = 131072
    plan = schedule_reshard(specs, 2, 2, 1, 2, bucket_bytes=embed // 4)
    _check(plan)
    first = plan.buckets[0]
    assert [plan.specs[i].name for i in first] == ["embedding.word_embeddings.weight"]
    # every group above the bound travels alone: the embedding, and each whole layer (a layer
    # is one weight-update group, megarl.weights.tensor_list.update_group)
    groups: dict[str, int] = {}
    for s in specs:
        groups[s.key] = groups.get(s.key, 0) + s.nbytes
    for members in plan.buckets:
        assert len({plan.specs[i].key for i in members}) == 1
    for r in range(4):
        assert plan.peak_dest_bytes(r) == max(groups.values())  # the largest group, alone
    big = schedule_reshard(specs, 2, 2, 1, 2, bucket_bytes=1 << 40)
    assert len(big.buckets) == 1


def test_layers_stay_in_one_bucket_with_their_modules_together():
    specs = actor_planned_tensors(DIMS, [4])
    plan = schedule_reshard(specs, 2, 1, 1, 1, bucket_bytes=1)  # every group alone
    for members in plan.buckets:
        names = [plan.specs[i].name for i in members]
        assert len({plan.specs[i].key for i in members}) == 1
        layers = {n.split(".")[2] for n in names if n.startswith("decoder.layers.")}
        assert len(layers) <= 1  # one whole layer, or one module outside the layers
        fc1 = [n for n in names if "linear_fc1" in n]
        assert [n[-2:] for n in fc1] in ([], ["#0", "#1"])  # gate and up, adjacent
        qkv = [n for n in names if "linear_qkv" in n]
        assert [n.rsplit(".", 1)[1] for n in qkv] in ([], ["weight", "bias"])
        if qkv:
            first = names.index(qkv[0])
            assert names[first : first + len(qkv)] == qkv  # weight and bias adjacent
    assert len(plan.buckets) == 4 + 3  # the layers; the embedding, the final norm, the head


def test_plan_is_deterministic_and_exact_minimum():
    specs = actor_planned_tensors(DIMS, [2, 2])
    a = schedule_reshard(specs, 2, 2, 2, 2, bucket_bytes=50_000, mode="shard")
    b = schedule_reshard(list(specs), 2, 2, 2, 2, bucket_bytes=50_000, mode="shard")
    assert a == b
    # zero-redundancy (shard mode) moves less than full mode, and a rank whose inference shard is
    # already local for a tensor receives nothing for it
    full = schedule_reshard(specs, 2, 2, 2, 2, bucket_bytes=50_000)
    assert all(a.recv_bytes(r) < full.recv_bytes(r) for r in range(8))
    # senders are spread over DP replicas
    senders = Counter(op.peer for rb in full.for_rank(0) for op in rb.ops if op.kind == "recv")
    assert len(senders) > 2


def test_plan_rejects_bad_inputs():
    specs = actor_planned_tensors(DIMS, [4])
    with pytest.raises(ValueError, match="does not divide the world size"):
        schedule_reshard(specs, 2, 1, 1, 4, bucket_bytes=10)
    with pytest.raises(ValueError, match=r"embedding\.word_embeddings\.weight.*tp=3"):
        schedule_reshard(specs, 3, 1, 1, 1, bucket_bytes=10)
    with pytest.raises(ValueError, match="do not sum"):
        actor_planned_tensors(DIMS, [1, 1])


def test_shard_mode_cuts_attention_rows_as_vllm_loads_them():
    """The grouped ranges, stacked and split, are exactly the q/k/v rows vLLM's TP rank loads:
    its share of the query heads, and its group's key/value heads (replicated beyond 4 ranks)."""
    specs = actor_planned_tensors(DIMS, [4])
    nh, kv, hd, h = DIMS.num_attention_heads, DIMS.num_kv_heads, DIMS.head_dim, DIMS.hidden_size
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * hd, h, generator=gen) for n in (nh, kv, kv))
    fused = fuse_qkv(q, k, v, kv)
    t = next(i for i, s in enumerate(specs) if s.name.endswith("linear_qkv.weight"))
    for infer_tp in (1, 2, 4, 8):
        plan = schedule_reshard(specs, 1, 1, 8, infer_tp, 1 << 30, mode="shard")
        for i in range(infer_tp):
            shard = torch.cat([fused[a:b] for a, b in need_ranges(specs[t], plan, i)])
            pieces = split_qkv_shard(shard, DIMS, infer_tp, i)
            heads = nh // infer_tp
            kv_head = i * kv // infer_tp if infer_tp <= kv else i // (infer_tp // kv)
            kv_rows = max(1, kv // infer_tp) * hd
            assert [start for _, start in pieces] == [i * heads * hd, kv_head * hd, kv_head * hd]
            for (piece, start), full in zip(pieces, (q, k, v), strict=True):
                assert torch.equal(piece, full[start : start + piece.shape[0]])
            assert [p.shape[0] for p, _ in pieces] == [heads * hd, kv_rows, kv_rows]


@pytest.mark.parametrize("vocab,infer_tp", [(500, 4), (100, 8), (512, 2)])
def test_shard_mode_pads_the_vocabulary_as_vllm(vocab, infer_tp):
    """vLLM pads the vocabulary to a multiple of 64 and splits that evenly: the last ranks hold
    fewer rows (or none)."""
    dims = replace(DIMS, vocab_size=vocab)
    specs = actor_planned_tensors(dims, [2, 2])
    plan = schedule_reshard(specs, 2, 2, 2, infer_tp, bucket_bytes=1 << 30, mode="shard")
    _check(plan)
    per = -(-vocab // 64) * 64 // infer_tp
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        t = next(i for i, s in enumerate(specs) if s.name == name)
        got = [need_ranges(specs[t], plan, i) for i in range(infer_tp)]
        assert got == [((min(i * per, vocab), min((i + 1) * per, vocab)),) for i in range(infer_tp)]


MOE = replace(
    DIMS,
    family="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    qkv_bias=False,
    qk_layernorm=True,
    ffn_hidden_size=64,
    num_experts=4,
    moe_ffn_hidden_size=32,
    moe_topk=2,
    moe_norm_topk=True,
)


@pytest.mark.parametrize("tp,pp,dp,ep", [(1, 1, 4, 2), (2, 1, 2, 2), (2, 2, 2, 2), (1, 2, 4, 4)])
@pytest.mark.parametrize("infer_tp", [1, 2, 4])
def test_shard_mode_with_experts(tp, pp, dp, ep, infer_tp):
    """Each rank receives its rollout TP slice of every expert (from that expert's EP rank)."""
    specs = actor_planned_tensors(MOE, [MOE.num_layers // pp] * pp, ep=ep)
    plan = schedule_reshard(specs, tp, pp, dp, infer_tp, bucket_bytes=20_000, mode="shard", ep=ep)
    _check(plan)
    fc2 = [i for i, s in enumerate(specs) if "local_experts" in s.name and "fc2" in s.name]
    assert len(fc2) == MOE.num_layers * MOE.num_experts
    for r in range(plan.world_size):
        i = r % infer_tp
        step = MOE.moe_ffn_hidden_size // infer_tp
        assert all(need_ranges(specs[t], plan, r) == ((i * step, (i + 1) * step),) for t in fc2)


def _qwen72b_layer_shard_bytes(d: ModelDims, tp: int) -> int:
    """One decoder layer's vLLM TP slice, bf16, by hand: q, k, v (with biases), o, gate, up and
    down split over TP; the two norms whole."""
    h, f, hd = d.hidden_size, d.ffn_hidden_size, d.head_dim
    qkv = (d.num_attention_heads + 2 * d.num_kv_heads) * hd
    split = qkv * h + qkv + h * d.num_attention_heads * hd + 3 * h * f
    return 2 * (split // tp + 2 * h)


def test_qwen25_72b_tp8_pp4_to_vllm_tp8_on_four_nodes():
    """Qwen2.5-72B trained at TP8 x PP4 (a stage per 8-GPU node), rolled out at vLLM TP8 (an
    engine per node): in shard mode each rank receives exactly the part of its vLLM slice it
    does not hold (~13.5 GB, every byte from other nodes); full mode moves ~141 GB per rank,
    ~110 GB of it across nodes."""
    _, d = resolve_model("Qwen2.5-72B")
    assert (d.num_layers, d.hidden_size, d.num_kv_heads) == (80, 8192, 8)
    specs = actor_planned_tensors(d, [20] * 4, itemsize=2)
    shard = schedule_reshard(specs, 8, 4, 1, 8, 2 << 30, mode="shard", ranks_per_node=8)
    layer = _qwen72b_layer_shard_bytes(d, 8)
    vocab = 2 * d.vocab_size * d.hidden_size // 8  # embedding or LM head slice
    final_norm = 2 * d.hidden_size
    need = 80 * layer + 2 * vocab + final_norm
    # what a rank holds of that: its stage's layers (same TP rank), the embedding on the first
    # stage, the LM head and the final norm on the last
    held = {0: 20 * layer + vocab, 1: 20 * layer, 2: 20 * layer, 3: 20 * layer + vocab + final_norm}
    full = reshard_traffic(specs, 8, 4, 1, 8, mode="full", ranks_per_node=8)
    rows = []
    for r in range(32):
        stage = r // 8
        assert shard.need_bytes(r) == need  # the vLLM TP slice it loads
        assert shard.min_recv_bytes(r) == need - held[stage]
        assert shard.recv_bytes(r) == shard.min_recv_bytes(r)  # the minimum, exactly
        assert shard.cross_node_recv_bytes(r, 8) == shard.recv_bytes(r)  # other stages' nodes
        rows.append((r, shard.recv_bytes(r), full[r].recv, full[r].cross_node))
    print(f"{'rank':>4} {'shard recv GB':>13} {'full recv GB':>12} {'full cross-node GB':>18}")
    for r, s, f, c in rows[::8]:
        print(f"{r:>4} {s / 1e9:13.2f} {f / 1e9:12.2f} {c / 1e9:18.2f}")
    assert abs(need / 1e9 - 18.18) < 0.01
    assert max(s for _, s, _, _ in rows) < 13.8e9
    assert all(140e9 < f < 142e9 and 107e9 < c < 111e9 for _, _, f, c in rows)
