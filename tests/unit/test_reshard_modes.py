"""Reshard settings without processes: ``rollout.engine.reshard_mode`` resolved per backend and model (and
refused before launch where vLLM cannot load slices), the slice checks the rollout engines make
before loading anything, the Hugging Face engine's sleep-level-2 weight drop and refill, and the
reshard figures ``megarl plan --json`` carries per layout (the planner's, key names fixed)."""

from __future__ import annotations

import json

import pytest
import torch

from megarl.cli import main as cli_main
from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.models.dims import ModelDims
from megarl.plan.known_models import resolve_model
from megarl.rollout.hf_rollout import drop_parameters, restore_parameters
from megarl.run.checks import _check_moe_options
from megarl.tools.testing.assets import tiny_qwen3_dir, tiny_qwen3_moe_dir
from megarl.weights.reshard_mode import resolve_reshard_mode
from megarl.weights.reshard_schedule import reshard_traffic
from megarl.weights.tensor_list import actor_planned_tensors
from megarl.weights.weight_shards import ShardSlice, check_shards


def test_auto_is_shard_where_the_backend_takes_slices():
    assert resolve_reshard_mode("auto", "vllm", is_moe=False) == "shard"
    assert resolve_reshard_mode("auto", "hf", is_moe=True) == "shard"
    # vLLM's fused-MoE loaders cut their own slice: whole expert tensors
    assert resolve_reshard_mode("auto", "vllm", is_moe=True) == "full"
    assert resolve_reshard_mode("full", "vllm", is_moe=False) == "full"
    with pytest.raises(ValueError, match=r"_load_w13.*rollout.engine.reshard_mode=full"):
        resolve_reshard_mode("shard", "vllm", is_moe=True)
    with pytest.raises(ValueError, match="is not one of"):
        resolve_reshard_mode("half", "vllm", is_moe=False)


def test_shard_mode_with_vllm_and_experts_is_refused_before_launch():
    def sections(path, *overrides):  # what _check_moe_options reads
        base = [f"model.path={path}", "data.train_files=[x.parquet]"]
        c = load_config(overrides=[*base, *overrides])
        return c.model, c.rollout, c.actor

    moe, dense = tiny_qwen3_moe_dir(), tiny_qwen3_dir()
    moe_dims, dense_dims = ModelDims.from_pretrained(moe), ModelDims.from_pretrained(dense)
    _check_moe_options(*sections(moe), moe_dims)  # auto: full for this model
    _check_moe_options(
        *sections(moe, "rollout.engine.reshard_mode=shard", "rollout.engine.backend=hf"), moe_dims
    )
    _check_moe_options(*sections(dense, "rollout.engine.reshard_mode=shard"), dense_dims)
    with pytest.raises(ConfigError, match=r"reshard_mode=shard.*rollout.engine.reshard_mode=auto"):
        _check_moe_options(*sections(moe, "rollout.engine.reshard_mode=shard"), moe_dims)


def test_slices_are_checked_against_the_rollout_model():
    expected = {"w": (8, 4), "norm": (4,)}
    check_shards(expected, [ShardSlice("w", (2, 4), 0, 6), ShardSlice("norm", (4,), None)], "m")
    check_shards(expected, [ShardSlice("w", (8, 0), 1, 4)], "m")  # an empty slice fits
    bad = [
        (ShardSlice("x", (2, 4), 0, 0), r"'x' is not a parameter"),
        (ShardSlice("w", (2, 4), 0, 7), r"'w' arrives as a slice of shape \[2, 4\] at \[7:9\]"),
        (ShardSlice("w", (2, 5), 0, 0), r"does not fit the rollout model's \[8, 4\]"),
        (ShardSlice("norm", (2,), None), r"'norm' arrives as a slice of shape \[2\], which"),
    ]
    for spec, match in bad:
        with pytest.raises(ValueError, match=match):
            check_shards(expected, [spec], "m")


def test_sleep_level_2_drops_weights_and_the_reload_refills_them():
    """The HF engine's level-2 sleep frees every parameter (a tied one once) and wake-up gives
    them fresh memory of the same shapes, which the next reshard fills."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=True))
    model[1].weight = model[0].weight  # tied
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    drop_parameters(model)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert model[1].weight is model[0].weight
    restore_parameters(model)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {
        n: tuple(t.shape) for n, t in before.items()
    }
    assert all(p.untyped_storage().nbytes() == p.numel() * 4 for p in model.parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
    assert model[1].weight is model[0].weight
    assert torch.equal(
        model(torch.tensor([3]))[0], before["1.bias"] + before["0.weight"] @ before["0.weight"][3]
    )


def test_plan_json_carries_each_layouts_reshard_bytes(capsys):
    """``megarl plan --json``: every layout has the planner's reshard figures under the fixed
    key names; at Qwen2.5-72B TP8 x PP4 -> TP8 on 4 nodes shard mode moves the minimum, ~13.8
    GB per rank, all from other nodes, where full mode would move ~141 GB."""
    args = ["plan", "--model", "Qwen2.5-72B", "--gpus", "32", "--gpu-memory", "141GB"]
    assert cli_main([*args, "--tp", "8", "--pp", "4", "--infer-tp", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    layouts = out["feasible"] + [e for v in out["variants"].values() for e in v]
    assert layouts
    for e in layouts:
        r = e["reshard"]
        assert {"recv_bytes_per_rank", "min_bytes_per_rank", "cross_node_bytes_per_rank"} <= set(r)
        assert r["mode"] == "shard" and r["recv_bytes_per_rank"] == r["min_bytes_per_rank"]
    r = out["feasible"][0]["reshard"]
    _, dims = resolve_model("Qwen2.5-72B")
    traffic = reshard_traffic(
        actor_planned_tensors(dims, [20] * 4, itemsize=2), 8, 4, 1, 8, "shard", ranks_per_node=8
    )
    assert r["recv_bytes_per_rank"] == max(t.recv for t in traffic)
    assert 13.7e9 < r["recv_bytes_per_rank"] == r["cross_node_bytes_per_rank"] < 13.8e9
    assert 140e9 < r["full_recv_bytes_per_rank"] < 142e9
    # a mixture-of-experts model rolls out with whole tensors (vLLM takes no expert slices)
    moe = ["plan", "--model", "Qwen3-30B-A3B", "--gpus", "8", "--json"]
    assert cli_main(moe) == 0
    feasible = json.loads(capsys.readouterr().out)["feasible"]
    assert feasible and all(e["reshard"]["mode"] == "full" for e in feasible)
