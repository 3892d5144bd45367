"""LoRA settings, target names, the fused-row layout of adapter outputs, and the reshard's merge."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.lora_settings import HF_PROJECTIONS, resolve_targets
from megarl.models.hf_map import fuse_qkv
from megarl.models.lora import LoraSettings, interleave_parts
from megarl.weights.lora_merge import MergedLocalTensors

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart_cpu.yaml"


def _load(*overrides: str):
    return load_config(QUICKSTART, list(overrides))


def test_lora_is_off_by_default_and_takes_peft_like_settings():
    cfg = _load()
    assert cfg.actor.lora.rank == 0
    cfg = _load("actor.lora.rank=64", "actor.lora.alpha=16", "actor.lora.target_modules=[q_proj]")
    assert cfg.actor.lora.rank == 64 and cfg.actor.lora.alpha == 16.0
    assert LoraSettings(rank=64, alpha=16).scale == 0.25


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("actor.lora.rank=-1",), "actor.lora.rank must be >= 0"),
        (("actor.lora.rank=8", "actor.lora.alpha=0"), "actor.lora.alpha must be > 0"),
        (("actor.lora.rank=8", "actor.lora.dropout=1.0"), "actor.lora.dropout"),
        (
            ("actor.lora.rank=8", "actor.lora.target_modules=[q_proj,lm_head]"),
            "unknown module 'lm_head'; valid names: ['all-linear', 'q_proj'",
        ),
        (("actor.lora.rank=8", "actor.lora.target_modules=[]"), "target_modules is empty"),
        (("critic.lora.rank=8",), "LoRA is for the actor only"),
        (
            ("actor.lora.rank=8", "model.transformer_impl=transformer_engine"),
            "set model.transformer_impl=local",
        ),
    ],
)
def test_bad_lora_settings_are_refused_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        _load(*overrides)


def test_alpha_is_not_checked_while_lora_is_off():
    assert _load("actor.lora.alpha=0").actor.lora.alpha == 0


def test_target_names_resolve_to_hf_projections():
    assert resolve_targets(["all-linear"]) == frozenset(HF_PROJECTIONS)
    assert resolve_targets(["linear_qkv", "down_proj"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "down_proj",
    }
    assert resolve_targets(["linear_fc1"]) == {"gate_proj", "up_proj"}


def test_interleaved_adapter_rows_follow_megatrons_fused_qkv_layout():
    """The adapters' q/k/v rows land where the name map's fuse_qkv puts the weights' rows."""
    gen = torch.Generator().manual_seed(0)
    groups, q_rows, kv_rows, cols = 2, 8, 4, 5
    q = torch.randn(groups * q_rows, cols, generator=gen)
    k = torch.randn(groups * kv_rows, cols, generator=gen)
    v = torch.randn(groups * kv_rows, cols, generator=gen)
    assert torch.equal(interleave_parts([q, k, v], groups, dim=0), fuse_qkv(q, k, v, groups))
    # along the last dimension (activations [s, b, rows]) the same layout
    acts = [t.T.unsqueeze(0) for t in (q, k, v)]
    fused = interleave_parts(acts, groups, dim=-1)
    assert torch.equal(fused[0].T, fuse_qkv(q, k, v, groups))
    # gate/up: one group, the parts stacked
    assert torch.equal(interleave_parts([q, k], 1, dim=0), torch.cat([q, k]))


def test_merged_local_tensors_merge_on_read_and_release_per_bucket():
    base = {0: torch.ones(2, 2), 1: torch.zeros(3)}
    calls = []

    def merge() -> torch.Tensor:
        calls.append(1)
        return base[0] + 1

    local = MergedLocalTensors(base, {0: merge})
    assert torch.equal(local[0], torch.full((2, 2), 2.0))
    assert torch.equal(local[0], torch.full((2, 2), 2.0)) and len(calls) == 1  # kept in a bucket
    assert local[1] is base[1]
    # values() (the executor reads dtype and device from them) stay the base views: no merge
    assert next(iter(local.values())) is base[0] and len(calls) == 1
    local.release()
    local[0]
    assert len(calls) == 2
    assert torch.equal(base[0], torch.ones(2, 2))  # the base is never modified


def test_plan_counts_the_adapters_alone_and_no_reference_copy():
    """At LoRA rank r the planner's grads and optimizer states are the adapters' (counted here
    from the shapes megarl.models.lora gives A and B), and the reference costs nothing."""
    from megarl.parallel import ParallelLayout
    from megarl.plan.known_models import resolve_model
    from megarl.plan.lora import lora_layer_params
    from megarl.plan.memory import GPU_BF16, estimate_memory
    from megarl.plan.workload import Workload

    _, dims = resolve_model("Qwen2.5-7B")
    h, hd, ffn = dims.hidden_size, dims.head_dim, dims.ffn_hidden_size
    q, kv, r, tp = dims.num_attention_heads * hd, dims.num_kv_heads * hd, 64, 2
    # column: A [r, h] whole, B [out/tp, r]; row: A [r, in/tp], B [h, r]
    per_layer = sum(r * h + o // tp * r for o in (q, kv, kv, ffn, ffn)) + (
        r * q // tp + h * r + r * ffn // tp + h * r
    )
    assert lora_layer_params(dims, tp, r) == per_layer
    layout = ParallelLayout(tp=tp, pp=1, dp=4)
    full = estimate_memory(dims, layout, Workload(seq_len=1536), GPU_BF16).worst
    lora = estimate_memory(dims, layout, Workload(seq_len=1536, lora_rank=r), GPU_BF16).worst
    adapters = dims.num_layers * per_layer
    fwd = lora.phase_items["forward-backward"]
    assert fwd["grads"] == adapters * GPU_BF16.grad_bytes
    assert fwd["optimizer"] == -(-adapters * GPU_BF16.main_param_bytes // 4) + -(
        -adapters * GPU_BF16.adam_bytes // 4
    )
    assert fwd["reference"] == 0 and full.phase_items["forward-backward"]["reference"] > 0
    assert lora.peak < full.peak
