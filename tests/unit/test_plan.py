"""megarl plan: model shapes, layout reasons, the memory model's terms, ranking, output, CLI."""

from __future__ import annotations

import json

import pytest

from megarl.cli import main
from megarl.errors import ConfigError
from megarl.parallel import ParallelLayout
from megarl.plan import (
    CPU_FP32,
    GPU_BF16,
    KNOWN_MODELS,
    Cluster,
    Options,
    Workload,
    estimate_memory,
    parse_bytes,
    resolve_model,
    search,
    to_json,
)
from megarl.plan.activations import GPU_TE_BF16, layer_bytes
from megarl.plan.report import format_text
from megarl.plan.search import uneven_split
from megarl.plan.units import GIB


def _plan(model: str, gpus: int, **workload):
    name, dims = resolve_model(model)
    return search(name, dims, Cluster(gpus=gpus), Workload(**workload))


# -- model shapes ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("Qwen2.5-0.5B", 0.494),
        ("Qwen2.5-1.5B", 1.544),
        ("Qwen2.5-7B", 7.616),
        ("Qwen2.5-14B", 14.770),
        ("Qwen2.5-32B", 32.764),
        ("Qwen2.5-72B", 72.706),
        ("Llama-3-8B", 8.030),
        ("Llama-3-70B", 70.554),
        ("Llama-3.1-8B", 8.030),
        ("Llama-3.1-70B", 70.554),
        ("Llama-3.1-405B", 405.853),
        ("SmolLM2-135M", 0.1345),
    ],
)
def test_known_models_have_their_published_parameter_counts(name, billions):
    _, dims = resolve_model(name)
    assert dims.num_parameters / 1e9 == pytest.approx(billions, rel=2e-3)


def test_model_names_resolve_with_org_prefix_and_instruct_suffix():
    assert resolve_model("Qwen/Qwen2.5-7B-Instruct")[0] == "Qwen2.5-7B"
    assert resolve_model("meta-llama/Meta-Llama-3.1-70B-Instruct")[0] == "Llama-3.1-70B"
    assert resolve_model("smollm2-135m")[1].num_kv_heads == 3
    assert len(KNOWN_MODELS) >= 12


def test_model_from_folder_and_config_file(tmp_path):
    cfg = {**KNOWN_MODELS["Qwen2.5-7B"], "model_type": "qwen2"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert resolve_model(str(tmp_path))[1] == resolve_model("Qwen2.5-7B")[1]
    assert resolve_model(str(tmp_path / "config.json"))[1].num_layers == 28


def test_model_errors_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="known model name"):
        resolve_model("Qwen9-1T")
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ConfigError, match="no file or folder"):
        resolve_model("./no/such/model")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        resolve_model(str(tmp_path))


def test_memory_sizes():
    assert parse_bytes("80GiB") == 80 * GIB
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("96G") == 96 * GIB
    assert parse_bytes("0", allow_zero=True) == 0
    with pytest.raises(ConfigError, match=r"e\.g\. 80GiB"):
        parse_bytes("80 gigs")


def test_cluster_errors_name_the_fix():
    with pytest.raises(ConfigError, match="--gpus 8 or 16"):
        Cluster(gpus=12)
    assert Cluster(gpus=4).tp_choices() == [1, 2, 4]  # part of one node


# -- layout reasons ----------------------------------------------------------------------------
def test_heads_not_divisible_by_tp_is_explained_with_the_valid_choices():
    result = _plan("Qwen2.5-7B", 8)
    reasons = result.rejected_by_reason()
    tp8 = [r for r in reasons if r.startswith("tp=8 does not divide")]
    assert tp8 and "Valid tp for this model: [1, 2, 4]" in tp8[0]
    assert [str(r.layout) for r in reasons[tp8[0]]] == ["TP8xPP1xDP1"]
    itp = result.infer_tp_rejected
    assert any("infer_tp=8" in k for k in itp) and [8] in itp.values()
    # SmolLM2's 9 heads / 3 KV heads: TP2 is impossible, TP1 fits.
    small = _plan("SmolLM2-135M", 2)
    assert any("Valid tp for this model: [1, 3]" in r for r in small.rejected_by_reason())


def test_layers_not_divisible_by_pp_use_an_uneven_split_or_are_explained():
    assert uneven_split(28, 4) is None
    assert uneven_split(28, 8) == (2, 4, 4, 4, 4, 4, 4, 2)
    assert uneven_split(126, 16) == (7, *[8] * 14, 7)
    assert uneven_split(30, 2) is None
    assert uneven_split(29, 2) == (14, 15)
    ParallelLayout(tp=1, pp=8, pp_layers=uneven_split(28, 8)).check_model(
        resolve_model("Qwen2.5-7B")[1].shape
    )
    result = _plan("SmolLM2-135M", 64)  # PP 64 > 30 layers
    assert any("larger than the model's 30 layers" in r for r in result.rejected_by_reason())


# -- the memory model's terms ------------------------------------------------------------------
TP2_DP4 = ParallelLayout(tp=2, pp=1, dp=4)


def _mem(model="Qwen2.5-7B", layout=TP2_DP4, **kw):
    options = kw.pop("options", Options())
    workload = Workload(**{"rollout": False, "reference": False, **kw})
    return estimate_memory(resolve_model(model)[1], layout, workload, GPU_BF16, options)


def test_weights_grads_and_sharded_optimizer():
    dims = resolve_model("Qwen2.5-7B")[1]
    stage = _mem().stages[0]
    items = stage.phase_items["forward-backward"]
    per_rank = dims.num_parameters / 2  # untied: embedding and output layer both split by TP
    assert items["weights"] == pytest.approx(2 * per_rank, rel=1e-3)
    assert items["grads"] == pytest.approx(4 * per_rank, rel=1e-3)  # fp32 grad buffer
    assert items["optimizer"] == pytest.approx(12 * per_rank / 4, rel=1e-3)  # over DP 4
    offloaded = _mem(options=Options(optimizer_offload=True)).stages[0]
    assert offloaded.phase_items["forward-backward"]["optimizer"] == 0


def test_activations_formula_recompute_and_pipeline_in_flight():
    dims = resolve_model("Qwen2.5-7B")[1]
    h, f, q, kv = 3584, 18944, 3584, 512
    assert layer_bytes(GPU_TE_BF16, dims, 1, 1, 4096) == 2 * 4096 * (4 * h + 2 * q + 2 * kv + 3 * f)
    # Sequence parallelism divides everything by TP.
    assert (
        layer_bytes(GPU_TE_BF16, dims, 4, 1, 4096)
        == layer_bytes(GPU_TE_BF16, dims, 1, 1, 4096) // 4
    )
    plain = _mem(seq_len=4096).worst.phase_items["forward-backward"]["activations"]
    rc = _mem(seq_len=4096, options=Options(recompute="full"))
    assert rc.worst.phase_items["forward-backward"]["activations"] < plain / 4
    # 1F1B: stage 0 of PP4 keeps 4 micro-batches of its 7 layers, the last stage one.
    pp4 = _mem(layout=ParallelLayout(tp=1, pp=4, dp=2), seq_len=4096, global_batch=64)
    per_layer = layer_bytes(GPU_TE_BF16, dims, 1, 1, 4096)
    first = pp4.stages[0].phase_items["forward-backward"]["activations"]
    assert first == pytest.approx(4 * 7 * per_layer, rel=0.02)


def test_cpu_numerics_count_fp32_weights_and_gloo_grad_copy():
    dims = resolve_model("SmolLM2-135M")[1]
    w = Workload(seq_len=64, global_batch=1, reference=False, rollout=False)
    stage = estimate_memory(dims, ParallelLayout(), w, CPU_FP32, Options(), reserve=0).stages[0]
    p = dims.num_parameters
    assert stage.phases["setup"] == pytest.approx(12 * p, rel=1e-3)  # module + param buffer + grads
    assert stage.phases["grad-sync"] == pytest.approx(20 * p, rel=1e-3)  # + Adam m, v + copy


def test_rollout_phase_holds_vllm_and_the_resident_models():
    est = _mem(rollout=True, reference=True)
    rollout = est.stages[0].phase_items["rollout"]
    assert rollout["rollout"] > 0 and rollout["reference"] > 0
    assert "grads" not in rollout  # megarl frees the actor's grad buffer for the rollout
    fraction = _mem(rollout=True, gpu_memory_utilization=0.5).stages[0]
    assert fraction.phase_items["rollout"]["rollout"] == int(0.5 * 80 * GIB)
    assert fraction.kv_capacity_tokens > 4096


# -- search, ranking, output -------------------------------------------------------------------
def test_qwen7b_on_8x80gb_has_feasible_ranked_layouts():
    result = _plan("Qwen2.5-7B", 8)
    assert len(result.feasible) >= 3
    times = [e.time.total for e in result.feasible]
    assert times == sorted(times)
    for e in result.feasible:
        assert e.memory.peak <= 80 * GIB
        assert e.layout.tp in (1, 2, 4) and e.layout.world_size == 8
    text = format_text(result, top=3)
    assert "Top 3 of" in text and "TP" in text


def test_70b_on_32x80gb_fits_some_layouts_and_explains_tp1_by_memory():
    result = _plan("Llama-3.1-70B", 32)
    assert result.feasible and not result.nothing_fits
    assert all(e.memory.peak <= 80 * GIB for e in result.feasible)
    memory = {str(r.layout): r for r in result.rejected if r.reason.startswith("memory")}
    tp1 = memory["TP1xPP1xDP32"]
    assert "> 80.0 GiB" in tp1.detail and tp1.evaluated.memory.peak > 300 * GIB
    assert tp1.evaluated.options.recompute == "full" and tp1.evaluated.options.optimizer_offload


def test_nothing_fits_says_so_and_what_to_change():
    result = _plan("Llama-3.1-405B", 16)
    assert result.nothing_fits and result.suggestions
    text = format_text(result)
    assert "NOTHING FITS" in text and "GiB per GPU" in text
    assert any("rollout alone cannot fit" in s for s in result.suggestions)


def test_json_output_is_complete():
    # GRPO compares a prompt's samples: the overrides below must pass the config's checks
    data = json.loads(json.dumps(to_json(_plan("Qwen2.5-7B", 8, samples_per_prompt=4))))
    assert data["model"]["num_layers"] == 28 and data["cluster"]["gpus"] == 8
    top = data["feasible"][0]
    for key in (
        "layout",
        "tp",
        "pp",
        "dp",
        "infer_tp",
        "recompute",
        "optimizer_offload",
        "peak_gib",
        "peak_phase",
        "items_gib",
        "stages",
        "step_time_s",
        "time_parts_s",
    ):
        assert key in top
    assert top["peak_gib"] <= 80
    # The overrides build this layout: they pass the run config's checks and say the same.
    from megarl.config import load_config

    cfg = load_config(overrides=["model.path=/m", "data.train_files=[t]", *top["overrides"]])
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.infer_tp) == (
        top["tp"],
        top["pp"],
        top["infer_tp"],
    )
    assert cfg.model.recompute == top["recompute"]
    assert (cfg.actor.optimizer_offload == 1.0) == top["optimizer_offload"]
    assert data["infeasible"] and all(g["reason"] and g["layouts"] for g in data["infeasible"])
    assert data["nothing_fits"] is False


# -- CLI ---------------------------------------------------------------------------------------
def test_cli_plan_prints_a_table_and_json(capsys):
    assert main(["plan", "--model", "Qwen2.5-7B", "--gpus", "8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "Top 3 of" in out and "Infeasible" in out
    assert main(["plan", "--model", "Llama-3.1-70B", "--gpus", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nope-7b", "--gpus", "8"], "known model name"),
        (["--model", "Qwen2.5-7B", "--gpus", "12"], "whole number of 8-GPU nodes"),
        (["--model", "Qwen2.5-7B", "--gpus", "8", "--gpu-memory", "lots"], "memory size"),
        (["--model", "Qwen2.5-7B", "--gpus", "8", "--gpu-memory-utilization", "2"], "fraction"),
    ],
)
def test_cli_plan_user_errors_exit_2(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_plan_missing_config_exits_2(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path), "--gpus", "8"]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_plan_overrides_are_every_setting_its_estimate_assumed(capsys):
    """The table prints each shown layout's overrides; the JSON's build a config whose preflight
    (on a node with the same fused kernels as the plan's numerics) peaks where the plan says."""
    from megarl.config import load_config, validate
    from megarl.gpu_defaults import Target
    from megarl.plan.preflight import Hardware, preflight

    argv = ["plan", "--model", "Qwen2.5-7B", "--gpus", "8", "--tp", "2", "--infer-tp", "2"]
    argv += ["--seq-len", "1536", "--response-len", "1024", "--tokens-per-micro-batch", "16384"]
    argv += ["--global-batch", "1280", "--n", "5", "--gpu-memory-utilization", "0.5"]
    assert main([*argv, "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "Overrides (megarl train CONFIG ...)" in text and "#1: parallel.tp=2" in text
    assert "actor.max_tokens_per_micro_batch=16384" in text
    assert main([*argv, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["feasible"][0]
    keys = {o.split("=")[0] for o in best["overrides"]}
    assert keys >= {
        "data.train_batch_size",
        "actor.ppo_mini_batch_size",
        "rollout.sampling.n",
        "actor.max_tokens_per_micro_batch",
        "data.max_prompt_length",
        "rollout.sampling.max_response_length",
        "model.recompute",
        "actor.optimizer_offload",
        "actor.packing",
        "rollout.engine.gpu_memory_utilization",
        "model.dtype",
    }
    cfg = load_config(overrides=["model.path=/m", "data.train_files=[t]", *best["overrides"]])
    validate(cfg, 8)
    node = Target(cuda=True, transformer_engine=True, wgrad_fusion_kernel=True, local_gpus=8)
    pf = preflight(cfg, resolve_model("Qwen2.5-7B")[1], Hardware(gpus_per_node=8), node)
    assert round(pf.memory.peak / GIB, 3) == best["peak_gib"]


def test_seq_mode_plan_gives_vllm_the_share_it_sized():
    result = _plan("Qwen2.5-7B", 8, samples_per_prompt=4)
    from megarl.plan.report import config_overrides

    top = result.feasible[0]
    [share] = [
        o for o in config_overrides(top, result.workload, 80 * GIB) if "gpu_memory_util" in o
    ]
    vllm = top.memory.worst.phase_items["rollout"]["rollout"]
    assert float(share.split("=")[1]) * 80 * GIB >= vllm  # at least what the plan gave vLLM
