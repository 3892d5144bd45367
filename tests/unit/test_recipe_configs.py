"""Every YAML under configs/ loads, validates at the world size it is written for, and (for the
recipes of real models) its layout fits that model's shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import load_config, validate
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# The numbers of the published Hugging Face config.json files that decide layouts.
_QWEN25_COMMON = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}
QWEN25_7B = {
    **_QWEN25_COMMON,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
}
QWEN25_72B = {
    **_QWEN25_COMMON,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}

# config file -> (world size it is written for, model config or None for the CPU configs)
INTENDED = {
    "quickstart_cpu.yaml": (1, None),
    "dapo_quickstart_cpu.yaml": (1, None),
    "smollm2_gsm_cpu.yaml": (1, None),
    "smollm2_calculator_cpu.yaml": (1, None),
    "grpo_qwen2_5_7b.yaml": (8, QWEN25_7B),
    "grpo_qwen2_5_7b_lora.yaml": (8, QWEN25_7B),
    "ppo_qwen2_5_7b.yaml": (8, QWEN25_7B),
    "grpo_qwen2_5_72b.yaml": (32, QWEN25_72B),
    "grpo_qwen3_30b_a3b.yaml": (8, QWEN3_30B_A3B),
}
RECIPES = [name for name, (_, model) in INTENDED.items() if model is not None]


def test_every_config_is_listed_here():
    found = sorted(p.name for p in CONFIGS.glob("*.yaml"))
    assert found == sorted(INTENDED), "add new configs to INTENDED with their world size"


@pytest.mark.parametrize("name", sorted(INTENDED))
def test_config_loads_and_validates_at_its_world_size(name):
    world, model = INTENDED[name]
    cfg = load_config(CONFIGS / name)
    validate(cfg, world)
    p = cfg.parallel
    layout = ParallelLayout.for_world(world, tp=p.tp, pp=p.pp, infer_tp=p.infer_tp, ep=p.ep)
    layout.check_rollout()
    if model is not None:
        layout.check_model(ModelDims.from_hf_config(model).shape)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_settings(name):
    cfg = load_config(CONFIGS / name)
    _check_planned_memory((CONFIGS / name).read_text(), cfg)
    assert (cfg.model.dtype, cfg.model.recompute) == ("bfloat16", "full")
    a = cfg.algorithm
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c) == (0.2, 0.2, 3.0)
    assert cfg.reward.custom_fn is None  # the GSM8K rule scorer, by data_source
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length) == (1024, 512)
    assert cfg.rollout.max_response_length == 1024
    if a.adv_estimator == "grpo":
        assert cfg.rollout.n == 5
        assert (a.use_kl_loss, a.kl_loss_coef, a.use_kl_in_reward) == (True, 0.001, False)
        assert (a.gamma, a.lam) == (None, None)  # grpo takes neither: giving them is an error
    else:
        assert a.adv_estimator == "gae" and cfg.model.critic_path is None
        assert (a.use_kl_loss, a.use_kl_in_reward, a.kl_ctrl) == (False, True, "adaptive")
        assert (a.target_kl, a.kl_coef) == (0.02, 0.001)
        assert (a.gamma, a.lam) == (0.99, 0.95)


def _check_planned_memory(text: str, cfg) -> None:
    """The config's planned-memory comment is what `megarl plan` says now for its own layout."""
    import json
    import re
    import shlex

    from megarl.cli import main as cli_main

    planned = re.search(r"# planned memory per GPU \(80 GiB, recompute on\): ([0-9.]+) GiB", text)
    command = re.search(r"#   from: megarl (plan .*)", text)
    assert planned and command, "the config must state its planned memory and the command"
    args = shlex.split(command.group(1))
    for flag, value in (("--tp", cfg.parallel.tp), ("--pp", cfg.parallel.pp)):
        assert args[args.index(flag) + 1] == str(value), (flag, "differs from the config")
    lora = args[args.index("--lora-rank") + 1] if "--lora-rank" in args else "0"
    assert lora == str(cfg.actor.lora.rank), "--lora-rank differs from the config"
    ep = args[args.index("--ep") + 1] if "--ep" in args else "1"
    assert ep == str(cfg.parallel.ep), ("--ep", "differs from the config")
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main([*args, "--json"]) == 0
    [variants] = json.loads(out.getvalue())["variants"].values()
    [ours] = [
        v
        for v in variants
        if v["recompute"] == "full"
        and not v["optimizer_offload"]
        and v["packing"] == cfg.actor.packing
    ]
    assert float(planned.group(1)) == round(ours["peak_gib"], 1)
    assert ours["peak_gib"] < 80
