"""Every YAML under configs/ loads, validates at the world size it is written for, and (for the
recipes of real models) its layout fits that model's shape."""

from __future__ import annotations

import json
import re
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
    "smollm2_arithmetic_cpu.yaml": (1, None),
    "chain_sft_cpu.yaml": (1, None),
    "chain_dpo_cpu.yaml": (1, None),
    "chain_grpo_cpu.yaml": (1, None),
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
    assert (cfg.model.dtype, cfg.model.recompute) == ("bfloat16", "full")
    a = cfg.algorithm
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c) == (0.2, 0.2, 3.0)
    assert cfg.reward.custom_fn is None  # the GSM8K rule scorer, by data_source
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length) == (1024, 512)
    assert cfg.rollout.sampling.max_response_length == 1024
    if a.adv_estimator == "grpo":
        assert cfg.rollout.sampling.n == 5
        assert (a.use_kl_loss, a.kl_loss_coef, a.use_kl_in_reward) == (True, 0.001, False)
        assert (a.gamma, a.lam) == (None, None)  # grpo takes neither: giving them is an error
    else:
        assert a.adv_estimator == "gae" and cfg.model.critic_path is None
        assert (a.use_kl_loss, a.use_kl_in_reward, a.kl_ctrl) == (False, True, "adaptive")
        assert (a.target_kl, a.kl_coef) == (0.02, 0.001)
        assert (a.gamma, a.lam) == (0.99, 0.95)


def _model_folder(root: Path, model: dict) -> Path:
    """A folder holding only the published config.json: all the preflight reads of a model."""
    folder = root / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model))
    return folder


def _data_files(root: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 1024  # one step's prompts: the checks read only the footers
    table = pa.table(
        {
            "prompt": [[{"role": "user", "content": f"question {i}"}] for i in range(rows)],
            "data_source": ["openai/gsm8k"] * rows,
            "reward_model": [{"ground_truth": "1", "style": "rule"}] * rows,
        }
    )
    out = []
    for split in ("train", "test"):
        pq.write_table(table, root / f"{split}.parquet")
        out.append(f"data.{split if split == 'train' else 'val'}_files=[{root / split}.parquet]")
    return out


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_passes_the_preflight_on_the_hardware_it_names(name, tmp_path, capsys):
    """`megarl train RECIPE --dry-run` for the nodes the recipe is written for exits 0, and the
    recipe's comment states the peak it prints."""
    from megarl.cli import main

    world, model = INTENDED[name]
    text = (CONFIGS / name).read_text()
    stated = re.search(
        r"# preflight \((\d+) nodes? x (\d+) GPUs of (\d+) GiB\): peak ([0-9.]+) GiB per GPU in "
        r"(\w+)",
        text,
    )
    command = re.search(r"#   from: megarl train (\S+) (--dry-run .*)", text)
    assert stated and command, "the recipe must state its preflight and the command"
    nodes, per_node, gib, peak, phase = stated.groups()
    assert command.group(1) == f"configs/{name}"
    flags = command.group(2).split()
    assert int(nodes) * int(per_node) == world
    assert flags[flags.index("--gpus-per-node") + 1] == per_node
    assert flags[flags.index("--gpu-memory") + 1] == f"{gib}GiB"
    assert (flags[flags.index("--nnodes") + 1] if "--nnodes" in flags else "1") == nodes
    overrides = [f"model.path={_model_folder(tmp_path, model)}", *_data_files(tmp_path)]
    code = main(["train", str(CONFIGS / name), *overrides, *flags, "--host-memory", "1TiB"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = re.search(
        r"preflight: every phase fits; peak ([0-9.]+) of ([0-9.]+) GiB per GPU in (\w+)", out
    )
    assert summary, out
    assert summary.groups() == (peak, f"{gib}.0", phase), out
    # the reserve, computed from the layout, item by item
    reserve = re.search(r"reserve per GPU: ([0-9.]+) GiB", out)
    assert reserve, out
    for item in ("CUDA context", "NCCL: ", "fragmentation", "communicators: "):
        assert item in out.split("reserve per GPU:")[1], item
    if name == "grpo_qwen3_30b_a3b.yaml":  # an MoE layout: 9 communicators
        assert float(reserve.group(1)) >= 6.0, out


def test_quickstart_recipes_prepare_what_their_configs_read():
    from megarl.tools.quickstart import RECIPES as QUICKSTART

    for name, recipe in QUICKSTART.items():
        cfg = load_config(Path(__file__).resolve().parents[2] / recipe.config)
        if recipe.post_training:  # its SFT config reads OUT/sft/, prepared from OUT/data/
            assert cfg.data.train_files[0].startswith(recipe.default_out + "/"), name
            continue
        assert cfg.model.path == f"{recipe.default_out}/model", name
        assert list(cfg.data.train_files) == [f"{recipe.default_out}/data/train.parquet"], name
        assert list(cfg.data.val_files) == [f"{recipe.default_out}/data/test.parquet"], name
        assert cfg.data.val_batch_size <= recipe.test_size, name
