"""MEGARL_SMOKE=1's settings (megarl/tools/smoke.py) run on a CPU and on a GPU node: every GPU
recipe under them passes the launch's own checks for that machine (a GPU node refused fp32 with
Transformer Engine and packing, and optimizer offload without TE), at a layout the tiny models
take, on the ranks the machine has."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import load_config, model_dtype, validate
from megarl.gpu_defaults import Target, check_for_target
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.tools.smoke import SmokeMachine, smoke_overrides, smoke_ranks
from tests.assets import tiny_char_llama_dir, tiny_char_qwen3_moe_dir

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = [
    "grpo_qwen2_5_7b.yaml",
    "grpo_qwen2_5_7b_lora.yaml",
    "ppo_qwen2_5_7b.yaml",
    "grpo_qwen2_5_72b.yaml",
    "grpo_qwen3_30b_a3b.yaml",
]
MACHINES = {
    "cpu": (SmokeMachine(cuda=False), Target(cuda=False)),
    "gpu node, TE": (SmokeMachine(cuda=True, gpus=8), Target.gpu_node(8)),
    "2 GPUs, no TE": (SmokeMachine(cuda=True, gpus=2), Target(cuda=True, local_gpus=2)),
    "1 GPU, TE": (SmokeMachine(cuda=True, gpus=1), Target.gpu_node(1)),
}


@pytest.mark.parametrize("machine", sorted(MACHINES))
@pytest.mark.parametrize("recipe", RECIPES)
def test_smoke_settings_pass_the_checks_of_the_machine(recipe, machine):
    smoke, target = MACHINES[machine]
    ep = load_config(CONFIGS / recipe).parallel.ep
    model = tiny_char_qwen3_moe_dir() if ep > 1 else tiny_char_llama_dir()
    cfg = load_config(
        CONFIGS / recipe,
        [
            f"model.path={model}",
            "data.train_files=[train.parquet]",
            "data.val_files=[test.parquet]",
            *smoke_overrides(smoke, ep),
        ],
    )
    world = smoke_ranks(smoke)
    validate(cfg, world)
    check_for_target(cfg.model, cfg.actor, target)  # raises what the launch would refuse
    p = cfg.parallel
    layout = ParallelLayout.for_world(world, tp=p.tp, pp=p.pp, infer_tp=p.infer_tp, ep=p.ep)
    layout.check_rollout()
    layout.check_model(ModelDims.from_pretrained(model).shape)
    assert model_dtype(cfg.model, target.cuda) == ("bfloat16" if target.cuda else "float32")
    assert cfg.actor.optimizer_offload == 0
    if ep > 1:
        assert cfg.rollout.engine.backend == "hf" and (p.ep == 2) == (world >= 2)


def test_a_gpu_node_gets_one_rank_per_gpu_up_to_four():
    assert [smoke_ranks(SmokeMachine(True, g)) for g in (1, 2, 3, 4, 8)] == [1, 2, 2, 4, 4]
    assert smoke_ranks(SmokeMachine(False)) == 4
    cpu = smoke_overrides(SmokeMachine(False), 1)
    # the CPU smoke run the e2e test launches: the layout it prints
    assert " ".join(cpu).count("parallel.tp=1 parallel.pp=2 parallel.infer_tp=2") == 1
    assert "model.dtype=float32" in cpu
    assert "model.dtype=float32" not in smoke_overrides(SmokeMachine(True, 4), 1)
