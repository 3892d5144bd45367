"""No layer is ever split across two weight-update calls.

vLLM's in-place reload processes a module once one call has loaded all of it; a module a call
loads only in part is rebuilt from uninitialised memory and copied back whole
(megarl.weights.tensor_list.update_group). The reshard and the asynchronous broadcast hand
the rollout engine one bucket per call, so every bucket must hold whole layers (every module and
every expert of each), whatever the bucket size. Checked on Qwen3-30B-A3B at its recipe's layout
(128 experts a layer, whose bf16 experts alone are 1.2 GB a layer: far above the 256 MiB bucket)
and on held-out shapes drawn below (uneven pipeline splits, expert parallelism, tiny and huge
buckets, both reshard modes)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.plan.known_models import resolve_model
from megarl.plan.memory import reshard_buffer_bytes
from megarl.rollout.async_links import BUCKET_BYTES
from megarl.weights.broadcast_schedule import schedule_broadcast
from megarl.weights.execute import hf_shapes_of
from megarl.weights.reshard_mode import resolve_reshard_mode
from megarl.weights.reshard_schedule import PlannedTensor, schedule_reshard
from megarl.weights.tensor_list import actor_planned_tensors

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def _check_whole_layers(
    specs: Sequence[PlannedTensor], buckets: Sequence[Sequence[int]], dims: ModelDims
) -> None:
    """Each layer's tensors sit in exactly one bucket, all of them, and the HF tensors each call
    hands the rollout engine are every one of that layer's."""
    home: dict[int, int] = {}
    for b, members in enumerate(buckets):
        for t in members:
            layer = _layer_of(specs[t].name)
            if layer is not None:
                assert home.setdefault(layer, b) == b, (
                    f"layer {layer} in buckets {home[layer]}, {b}"
                )
    assert sorted(home) == list(range(dims.num_layers))
    every_hf = hf_shapes_of(specs, dims)
    hf_layers: dict[int, set[str]] = {}
    for name in every_hf:
        m = _HF_LAYER.match(name)
        if m:
            hf_layers.setdefault(int(m.group(1)), set()).add(name)
    for b, members in enumerate(buckets):
        handed = set(hf_shapes_of([specs[t] for t in members], dims))
        for layer in {_layer_of(specs[t].name) for t in members} - {None}:
            assert hf_layers[layer] <= handed, f"bucket {b} lacks part of layer {layer}"


def test_qwen3_30b_a3b_recipe_layout_sends_whole_layers():
    _, dims = resolve_model("Qwen3-30B-A3B")
    layout = ParallelLayout(tp=4, pp=1, dp=2, ep=2, infer_tp=4)  # configs/grpo_qwen3_30b_a3b.yaml
    specs = actor_planned_tensors(dims, layout.layers_per_stage(dims.num_layers), 2, ep=2)
    experts = [s for s in specs if ".local_experts." in s.name]
    assert len(experts) == 48 * 128 * 3  # gate and up (as two parts of fc1) and down
    mode = resolve_reshard_mode("auto", "vllm", dims.is_moe)
    assert mode == "full"  # vLLM's fused-MoE loaders cut their own slices
    plan = schedule_reshard(specs, 4, 1, 2, 4, 256 << 20, mode=mode, ep=2)
    _check_whole_layers(plan.specs, plan.buckets, dims)
    # one layer's bf16 experts are 1.2 GB: each layer travels alone, above the bucket size
    assert len(plan.buckets) >= dims.num_layers
    layer_bytes = 128 * 3 * dims.hidden_size * dims.moe_ffn_hidden_size * 2
    assert max(plan.peak_dest_bytes(r) for r in range(8)) > layer_bytes > 256 << 20
    broadcast = schedule_broadcast(specs, 4, 1, 2, BUCKET_BYTES, ep=2)
    _check_whole_layers(broadcast.specs, broadcast.buckets, dims)
    # the memory plan's rollout phase holds two such buckets: at least what the schedule holds
    planned = reshard_buffer_bytes(dims, 4)
    inflight = max(plan.peak_inflight_dest_bytes(r) for r in range(8))
    assert inflight <= planned <= 1.05 * inflight


def test_the_planned_reshard_buffers_hold_the_dense_schedule():
    _, dims = resolve_model("Qwen2.5-7B")
    specs = actor_planned_tensors(dims, [28], 2)
    plan = schedule_reshard(specs, 2, 1, 4, 2, 256 << 20, mode="shard")
    inflight = max(plan.peak_inflight_dest_bytes(r) for r in range(8))
    assert inflight <= reshard_buffer_bytes(dims, 2)


def _moe_dims(layers: int, experts: int, topk: int, family: str) -> ModelDims:
    common = {
        "hidden_act": "silu",
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 96,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    if family == "mixtral":
        return ModelDims.from_hf_config(
            {
                **common,
                "architectures": ["MixtralForCausalLM"],
                "intermediate_size": 48,
                "num_local_experts": experts,
                "num_experts_per_tok": topk,
            }
        )
    return ModelDims.from_hf_config(
        {
            **common,
            "architectures": ["Qwen3MoeForCausalLM"],
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "num_experts": experts,
            "num_experts_per_tok": topk,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "head_dim": 16,
            "use_sliding_window": False,
        }
    )


@given(
    layers=st.integers(2, 6),
    experts=st.sampled_from([4, 8]),
    family=st.sampled_from(["qwen3_moe", "mixtral"]),
    pp=st.sampled_from([1, 2]),
    ep=st.sampled_from([1, 2]),
    tp=st.sampled_from([1, 2]),
    bucket=st.sampled_from([1, 3000, 40_000, 1 << 40]),
    mode=st.sampled_from(["full", "shard"]),
)
def test_held_out_moe_shapes_send_whole_layers(layers, experts, family, pp, ep, tp, bucket, mode):
    dims = _moe_dims(layers, experts, 2, family)
    dp = 2
    stages = [layers] if pp == 1 else [layers // 2, layers - layers // 2]  # uneven when odd
    specs = actor_planned_tensors(dims, stages, 4, ep=ep)
    plan = schedule_reshard(specs, tp, pp, dp, tp, bucket, mode=mode, ep=ep)
    _check_whole_layers(plan.specs, plan.buckets, dims)
    broadcast = schedule_broadcast(specs, tp, pp, dp, bucket, ep=ep)
    _check_whole_layers(broadcast.specs, broadcast.buckets, dims)


def test_a_dense_model_sends_whole_layers_too():
    _, dims = resolve_model("Qwen2.5-7B")
    specs = actor_planned_tensors(dims, [14, 14], 2)
    plan = schedule_reshard(specs, 2, 2, 2, 2, 64 << 20, mode="shard")
    _check_whole_layers(plan.specs, plan.buckets, dims)
