"""The memory preflight (`megarl train CONFIG --dry-run`): each phase's items against sizes
computed here by hand for Qwen2.5-7B at TP2 x DP4 on 8 x 80 GiB, what it names when a phase does
not fit and the settings it offers (each re-checked), and the command line: exit codes, no model
built, megatron never imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.gpu_defaults import Target
from megarl.plan import KNOWN_MODELS, resolve_model
from megarl.plan.preflight import Hardware, preflight, with_overrides
from megarl.plan.reserve import CUDA_CONTEXT, NCCL_FIRST, NCCL_PEER_BUFFERS
from megarl.plan.units import GIB
from megarl.plan.workload import Workload

ROOT = Path(__file__).resolve().parents[2]
GPU = Target.gpu_node(8)
HW = Hardware(gpus_per_node=8, nnodes=1, gpu_memory=80 * GIB, host_memory=1 << 40)
# configs/grpo_qwen2_5_7b.yaml's sizes
RECIPE = [
    "model.path=/models/qwen7b",
    "data.train_files=[t.parquet]",
    "parallel.tp=2",
    "parallel.infer_tp=2",
    "data.train_batch_size=1024",
    "data.max_prompt_length=512",
    "rollout.sampling.n=5",
    "rollout.sampling.max_response_length=1024",
    "actor.ppo_mini_batch_size=256",
    "actor.max_tokens_per_micro_batch=16384",
    "model.recompute=full",
    "rollout.engine.gpu_memory_utilization=0.45",
]
# Qwen2.5-7B, by hand: hidden, query width, KV width, FFN, vocabulary, layers; TP 2, DP 4
H, Q, KV, F, V, L = 3584, 3584, 4 * 128, 18944, 152064, 28
TP, DP = 2, 4
LAYER = (H * (Q + 2 * KV) + (Q + 2 * KV) + Q * H + 3 * H * F) // TP + 2 * H  # + 2 norms
P = L * LAYER + 2 * (V * H // TP) + H  # embedding + LM head shards, final norm
TOKENS = 16384  # the micro-batch budget
# The reserve of TP2 x DP4 with vLLM TP2: the CUDA context, 5 NCCL communicators over several
# ranks (world, TP, DP, the distributed optimizer's grad-norm group, vLLM's TP), 2% of 80 GiB
RESERVE = CUDA_CONTEXT + NCCL_FIRST + 5 * NCCL_PEER_BUFFERS + int(0.02 * 80 * GIB)
VLLM = int(0.45 * 80 * GIB)  # rollout.engine.gpu_memory_utilization 0.45 of 80 GiB


def _pinned(sizes) -> int:
    """Pinned bytes of one block per size, each rounded up to a power of two (by hand)."""
    return sum(1 << (s - 1).bit_length() for s in sizes)


# Qwen2.5-7B's tensors on one TP2 rank, by hand: per layer QKV, its bias, attention output,
# fused gate/up, down, 2 norms; the embedding and LM head shards, the final norm
TENSORS = [
    H * (Q + 2 * KV) // TP,
    (Q + 2 * KV) // TP,
    Q * H // TP,
    2 * H * F // TP,
    H * F // TP,
    H,
    H,
] * L + [V * H // TP, V * H // TP, H]


def _dims():
    return resolve_model("Qwen2.5-7B")[1]


def _check(*overrides, hardware=HW):
    return preflight(
        load_config(overrides=[*RECIPE, *overrides]), _dims(), hardware, GPU, suggest=False
    )


@pytest.fixture(scope="module")
def recipe():
    return _check()


def _items(pf, phase):
    return pf.phase(phase).items


def test_parameters_by_hand_match_the_planner():
    from megarl.plan.params import stage_params, stage_tensor_numels

    assert stage_params(_dims(), TP, 1, 0, L).total == P
    assert sorted(stage_tensor_numels(_dims(), TP, 1, 0, L)) == sorted(TENSORS)
    assert sum(TENSORS) == P


def test_the_reserve_is_the_layouts_item_by_item(recipe):
    reserve = recipe.memory.reserve
    assert reserve.total == RESERVE > 6 * GIB
    assert [g.name.split(" (")[0] for g in reserve.groups] == [
        "world",
        "tensor parallel",
        "data parallel",
        "distributed optimizer",
        "vLLM tensor parallel",
    ]
    assert [g.ranks for g in reserve.groups] == [8, 2, 4, 8, 2]


def test_startup_holds_the_models_beside_vllms_whole_budget(recipe):
    items = _items(recipe, "startup")
    assert items == {
        "weights": 2 * P,  # bf16
        "grads": 4 * P,  # fp32 grad buffer
        "optimizer": P,  # fp32 master params over DP 4; Adam's m and v come at step 1
        "reference": 2 * P,
        "rollout": VLLM,
        "reserve": RESERVE,
    }


def test_rollout_frees_grads_and_moves_adam_to_the_host(recipe):
    assert _items(recipe, "rollout") == {
        "weights": 2 * P,
        "optimizer": P,
        "reference": 2 * P,
        "rollout": VLLM,
        "reserve": RESERVE,
    }
    vllm_weights = 2 * P  # vLLM's TP2 shard is the actor's
    workspace = GIB + 2 * 256 * V * 4  # + the sampler's fp32 logits of max_num_seqs sequences
    kv_per_token = 2 * L * (4 // 2) * 128 * 2
    kv = min(s.kv_capacity_tokens for s in recipe.memory.stages)
    assert kv == (VLLM - vllm_weights - workspace) // kv_per_token


def test_scoring_after_vllm_sleeps_in_the_updates_micro_batches(recipe):
    items = _items(recipe, "scoring")
    assert {k: items[k] for k in ("weights", "grads", "optimizer", "reference")} == {
        "weights": 2 * P,
        "grads": 4 * P,
        "optimizer": 3 * P,  # master params + m + v over DP 4
        "reference": 2 * P,
    }
    hidden = 2 * TOKENS * H // TP * 2  # stage input and output, split over TP (SP)
    layer = TOKENS * (4 * H // TP + (2 * Q + 2 * KV + 3 * F) // TP) * 2
    chunk_rows = (1 << 25) // (V // TP)
    logits = TOKENS * (V // TP) * 2  # bf16 logits of at most the budget's positions
    loss = logits + 2 * chunk_rows * (V // TP) * 4 + TOKENS * 4
    assert loss > layer  # the output layer is the scoring pass's peak
    assert items["activations"] == hidden + loss
    # vLLM's, the actor's and the reference's logprobs of this rank's 1,280 rollouts
    assert items["scores"] == 3 * (5120 // DP) * 1024 * 4
    # a rollout batch 4x larger scores in the same micro-batches: only the scores grow
    bigger = _items(
        _check("data.train_batch_size=4096", "actor.ppo_mini_batch_size=1024"), "scoring"
    )
    assert bigger["activations"] == items["activations"]
    assert bigger["scores"] == 4 * items["scores"]


def test_update_holds_the_adam_state_and_one_micro_batch(recipe):
    items = _items(recipe, "update")
    assert items["optimizer"] == 3 * P and items["grads"] == 4 * P
    checkpoints = L * TOKENS * H // TP * 2  # full recompute: each layer's input
    final = 2 * TOKENS * H // TP * 2  # final norm and LM head inputs
    one_layer = TOKENS * (4 * H // TP + (2 * Q + 2 * KV + 3 * F) // TP) * 2  # re-run in backward
    logits = TOKENS * (V // TP) * 2
    chunk_rows = (1 << 25) // (V // TP)
    # logits and their gradient, with the log-prob's fp32 chunks or, without the weight-gradient
    # fusion (no apex on the node), the LM head's bf16 weight gradient before it is accumulated
    lm_head_grad = (V // TP) * H * 2
    loss = 2 * logits + max(2 * chunk_rows * (V // TP) * 4, lm_head_grad)
    assert items["activations"] == checkpoints + final + one_layer + loss


def test_host_memory_per_rank_and_node(recipe):
    host = recipe.host
    dp0, dp1 = host.ranks[(0, 0)], host.ranks[(0, 1)]
    # Adam's m and v of each parameter of the rank's shard, a pinned block each: the shard's
    # tensors are a quarter of the stage's, so their rounding is the stage's, by hand
    moments = int(2 * P * _pinned(4 * n for n in TENSORS) / (4 * P))
    assert dp0["rollout"] == {"optimizer_offload": 0, "adam_moments": moments}
    assert 2 * P < moments < 4 * P  # rounding up to powers of two takes up to twice as much
    # asleep at any level vLLM keeps its runtime and CUDA-graph pools (its 1 GiB workspace) in
    # pinned host memory; sleep level 2 (the default) drops its weights, level 1 keeps its TP
    # shard there too, a block per tensor (vLLM's TP2 shard has the actor's shapes, bf16)
    assert dp0["training"] == {"optimizer_offload": 0, "vllm_asleep": GIB}
    level1 = _check("rollout.engine.sleep_level=1").host
    vllm_host = GIB + int(2 * P * _pinned(2 * n for n in TENSORS) / (2 * P))
    assert level1.ranks[(0, 0)]["training"] == {"optimizer_offload": 0, "vllm_asleep": vllm_host}
    state = 12 * -(-P // DP)  # its own shard's fp32 params, m, v: no gather (optimizer_shards)
    assert dp1["save"]["checkpoint"] == state
    assert dp0["save"]["checkpoint"] == state + 2 * P  # DP rank 0 also writes the weights
    node = 8 * state + 2 * (2 * P) + 8 * GIB  # 8 ranks; 2 of them (TP0, TP1) are DP rank 0
    assert host.nodes == [{"rollout": 8 * moments, "training": 8 * GIB, "save": node}]
    assert level1.nodes[0]["training"] == 8 * vllm_host
    assert level1.nodes[0]["save"] == node - 8 * GIB + 8 * vllm_host


def test_optimizer_offload_moves_the_main_params_and_its_host_copies_are_pinned():
    """With the offload (megatron's precision-aware hybrid optimizer) the GPU keeps no optimizer
    state: the fp32 main params leave with Adam's moments (12 bytes per parameter of the shard).
    On the host: 16 bytes per parameter, the fp32 grad copies pinned and so are the 16-bit
    copies the optimizer pins on its way to fp32."""
    offloaded = _check("actor.optimizer_offload=1.0")
    for phase in ("startup", "rollout", "update", "scoring"):
        assert "optimizer" not in _items(offloaded, phase), phase
    shard = -(-P // DP)
    extra = 4 * shard * (_pinned(4 * n for n in TENSORS) / (4 * P) - 1)
    extra += shard * 2 * _pinned(2 * n for n in TENSORS) / (2 * P)
    assert offloaded.host.ranks[(0, 0)]["training"]["optimizer_offload"] == int(16 * shard + extra)
    from dataclasses import replace

    from megarl.plan.memory import offload_freed_bytes_per_param

    assert offload_freed_bytes_per_param(offloaded.numerics) == 12
    # without Transformer Engine there is no precision-aware optimizer: megatron keeps the main
    # params on the GPU (8 bytes freed, as measured on an H200); such a node refuses the offload
    assert (
        offload_freed_bytes_per_param(replace(offloaded.numerics, offload_main_params=False)) == 8
    )


def test_micro_batch_shapes():
    budget = Workload(seq_len=1536, micro_batch_tokens=16384, response_len=1024)
    assert budget.micro_batch_shape(packing=True) == (1, 16384)
    assert budget.micro_batch_shape(packing=False) == (10, 1536)  # whole padded rows
    long = Workload(seq_len=20000, micro_batch_tokens=16384, response_len=1024)
    assert long.micro_batch_shape(packing=True) == (1, 20000)  # one sequence over the budget
    count = Workload(seq_len=1536, micro_batch=4, output_positions=1024, response_len=1024)
    assert count.logits_rows() == 4 * 1024 and budget.logits_rows() == 16384


def test_a_phase_that_does_not_fit_is_named_with_checked_fixes():
    cfg = load_config(
        overrides=[*RECIPE, "rollout.sampling.max_response_length=16384", "model.recompute=none"]
    )
    pf = preflight(cfg, _dims(), HW, GPU)
    assert not pf.fits
    [problem] = pf.problems
    assert (problem.where, problem.item) == ("update", "activations")
    assert "activations" in problem.message and "80.0 GiB" in problem.message
    assert ["model.recompute=full"] in pf.suggestions
    for fix in pf.suggestions:
        assert preflight(with_overrides(cfg, fix), _dims(), HW, GPU, suggest=False).fits, fix


def test_vllm_that_cannot_start_names_its_budget():
    # Qwen3-30B-A3B as configs/grpo_qwen3_30b_a3b.yaml has it, at vLLM's default 0.5 of the GPU
    dims = resolve_model("Qwen3-30B-A3B")[1]
    moe = [*RECIPE, "parallel.tp=4", "parallel.infer_tp=4", "parallel.ep=2"]
    moe += ["actor.max_tokens_per_micro_batch=8192", "actor.optimizer_offload=1.0"]
    moe += ["rollout.engine.gpu_memory_utilization=0.5"]
    cfg = load_config(overrides=moe)
    pf = preflight(cfg, dims, HW, GPU)
    [problem] = pf.problems
    assert (problem.where, problem.item) == ("startup", "rollout")
    assert "rollout.engine.gpu_memory_utilization=0.5" in problem.message
    assert pf.suggestions[0] == ["rollout.engine.gpu_memory_utilization=0.45"]
    assert preflight(with_overrides(cfg, pf.suggestions[0]), dims, HW, GPU, suggest=False).fits
    assert pf.memory.reserve.total >= 6 * GIB  # 9 communicators of an MoE layout


def test_the_critic_is_planned_as_built_without_offload():
    ppo = _check(
        "actor.optimizer_offload=1.0",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_loss=false",
        "algorithm.gamma=0.99",
        "algorithm.lam=0.95",
    )
    critic = _items(ppo, "update")["critic"]
    # weights (bf16), fp32 grads, and its optimizer over DP 4 on the GPU: 2 + 4 + 12 / 4 bytes
    params = P - V * H // TP + H + 1  # a value head (hidden + 1) for the LM head shard
    assert critic == 2 * params + 4 * params + -(-12 * params // DP)


def test_moe_dispatch_buffers_are_planned():
    from megarl.plan.activations import GPU_TE_BF16, moe_dispatch_bytes, moe_stored_bytes

    dims = resolve_model("Qwen3-30B-A3B")[1]
    tokens, tp, k, h = 8192, 4, 8, 2048
    routed = tokens // tp * k * h  # a rank's routed token copies (sequence parallel over TP4)
    assert moe_stored_bytes(GPU_TE_BF16, dims, tp, 1, tokens) == tp * routed * 2
    assert moe_dispatch_bytes(GPU_TE_BF16, dims, tp, 1, tokens) == (2 + 2 * tp) * routed * 2
    assert moe_dispatch_bytes(GPU_TE_BF16, _dims(), tp, 1, tokens) == 0  # dense


def test_a_kv_cache_smaller_than_one_sequence_is_refused():
    pf = preflight(
        load_config(overrides=[*RECIPE, "rollout.engine.gpu_memory_utilization=0.1"]),
        _dims(),
        HW,
        GPU,
    )
    assert ("rollout", "kv_cache") in {(p.where, p.item) for p in pf.problems}
    assert any(s[0].startswith("rollout.engine.gpu_memory_utilization=0.") for s in pf.suggestions)


def test_host_memory_of_a_save_is_checked():
    small = Hardware(gpus_per_node=8, gpu_memory=80 * GIB, host_memory=128 * GIB)
    cfg = load_config(overrides=[*RECIPE, "rollout.engine.sleep_level=1"])
    pf = preflight(cfg, _dims(), small, GPU)
    [problem] = pf.problems
    assert problem.where == "host save" and problem.item == "checkpoint"
    assert ["rollout.engine.sleep_level=2"] in pf.suggestions  # vLLM's host copy goes


# -- the command line ------------------------------------------------------------------------


def _inputs(tmp_path: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = tmp_path / "Qwen2.5-7B-Instruct"
    model.mkdir()  # a folder holding only config.json is enough
    (model / "config.json").write_text(
        json.dumps({**KNOWN_MODELS["Qwen2.5-7B"], "model_type": "qwen2"})
    )
    rows = [[{"role": "user", "content": f"q{i}"}] for i in range(1024)]
    # columns of both a prompt file (the policy, scored by the built-in GSM8K scorer) and a
    # preference file (train-rm)
    table = {
        "prompt": rows,
        "data_source": ["openai/gsm8k"] * len(rows),  # what the built-in scorer reads
        "reward_model": [{"ground_truth": "1", "style": "rule"}] * len(rows),
        "chosen": ["a"] * len(rows),
        "rejected": ["b"] * len(rows),
    }
    pq.write_table(pa.table(table), tmp_path / "train.parquet")
    return [
        f"model.path={model}",
        f"data.train_files=[{tmp_path / 'train.parquet'}]",
        "data.val_files=[]",
    ]


def test_dry_run_exits_2_naming_the_item_before_any_model_is_built(tmp_path):
    overflow = [
        "actor.micro_batch_size=64",
        "rollout.sampling.max_response_length=16384",
        "model.recompute=none",
    ]
    argv = ["train", str(ROOT / "configs" / "grpo_qwen2_5_7b.yaml"), *_inputs(tmp_path), *overflow]
    argv += ["--dry-run", "--gpus-per-node", "8", "--gpu-memory", "80GiB"]
    script = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from megarl.cli import main\n"
        f"code = main({argv!r})\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'vllm', 'transformer_engine'})\n"
        "print('HEAVY', heavy, 'SECONDS', round(time.perf_counter() - t, 1))\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout
    assert "preflight: DOES NOT FIT" in out
    assert "update needs" in out and "its activations" in out
    assert "model.recompute=full" in out.split("each checked")[1]
    assert "HEAVY []" in out  # no megatron, no vLLM: no model was built


def test_dry_run_of_a_fitting_config_exits_0_and_says_what_it_assumed(tmp_path, capsys):
    from megarl.cli import main

    argv = [
        "train",
        str(ROOT / "configs" / "grpo_qwen2_5_7b.yaml"),
        *_inputs(tmp_path),
        "--dry-run",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "preflight: every phase fits" in out
    assert "(assumed: --gpu-memory)" in out and "(assumed: --gpus-per-node)" in out
    for phase in ("startup", "rollout", "scoring", "update"):
        assert any(line.startswith(phase) for line in out.splitlines()), phase
    assert "host memory per node" in out and "save" in out


def test_dry_run_refuses_what_the_gpu_node_refuses(tmp_path, capsys):
    from megarl.cli import main

    argv = ["train", str(ROOT / "configs" / "grpo_qwen2_5_7b.yaml"), *_inputs(tmp_path)]
    assert main([*argv, "model.dtype=float32", "--dry-run"]) == 2
    assert "THD" in capsys.readouterr().err
    assert main([*argv, "parallel.tp=3", "--dry-run"]) == 2  # the launch's own layout checks
    assert "tp" in capsys.readouterr().err


def test_dry_run_of_a_reward_model_config_checks_it_only(tmp_path, capsys):
    from megarl.cli import main

    argv = ["train-rm", str(ROOT / "configs" / "grpo_qwen2_5_7b.yaml"), *_inputs(tmp_path)]
    assert main([*argv, "data.train_batch_size=64", "--dry-run"]) == 0
    assert "models policy runs" in capsys.readouterr().out


def test_async_jobs_are_checked_on_the_trainer_ranks_and_not_planned(tmp_path, capsys):
    """rollout.placement.mode=async: the dry run makes the launch's checks over the trainer ranks (the job
    less the rollout group) and says that it plans no memory; on CUDA the launch stops unless
    --no-preflight."""
    import argparse

    from megarl import dry_run
    from megarl.cli import main

    argv = ["train", str(ROOT / "configs" / "grpo_qwen2_5_7b.yaml"), *_inputs(tmp_path)]
    split = ["rollout.placement.mode=async", "parallel.rollout_ranks=4"]  # 4 trainers at TP2: DP2
    assert main([*argv, *split, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "config checks passed" in out and "not rollout.placement.mode=async" in out
    assert "every phase fits" not in out
    # 2 rollout ranks leave 6 trainers (DP3), which cannot split the batch of 1024
    assert (
        main([*argv, "rollout.placement.mode=async", "parallel.rollout_ranks=2", "--dry-run"]) == 2
    )
    assert "train_batch_size" in capsys.readouterr().err
    cfg = load_config(overrides=[*RECIPE, *split])
    cuda = Target(cuda=True, transformer_engine=True, local_gpus=8)
    args = argparse.Namespace(config="run.yaml", no_preflight=False, gpu_memory=None)
    args.host_memory = None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dry_run, "this_machine", lambda: cuda)
        assert dry_run.before_launch(args, cfg, 8, 1, None) == dry_run.EXIT_DOES_NOT_FIT
        assert "--no-preflight" in capsys.readouterr().err
        args.no_preflight = True
        assert dry_run.before_launch(args, cfg, 8, 1, None) == 0


def test_a_reward_model_is_resident_and_scores_whole_sequences():
    cfg = load_config(overrides=[*RECIPE, "actor.micro_batch_size=64"])
    pf = preflight(cfg, _dims(), HW, GPU, reward_model=_dims(), suggest=False)
    # frozen bf16 weights with a value head (hidden + 1) instead of the LM head's shard
    rm = 2 * (P - V * H // TP + H + 1)
    for phase in ("build", "startup", "rollout", "scoring", "update"):
        assert _items(pf, phase)["reward_model"] == rm, phase
    # it scores micro_batch_size whole sequences per forward, whatever the token budget
    tokens = 64 * 1536
    hidden = 2 * tokens * H // TP * 2
    layer = tokens * (4 * H // TP + (2 * Q + 2 * KV + 3 * F) // TP) * 2
    assert _items(pf, "scoring")["activations"] == hidden + layer


def test_elastic_restart_layouts_are_checked_by_the_preflight(monkeypatch):
    from megarl.cluster import memory_fit
    from megarl.parallel import ParallelLayout

    monkeypatch.setattr(memory_fit, "this_machine", lambda: GPU)
    cfg = load_config(overrides=RECIPE)
    fits = memory_fit.gpu_memory_check(_dims(), 80 * GIB, host_memory=1 << 40)
    assert fits(cfg, ParallelLayout(tp=2, dp=4, infer_tp=2)) is None
    assert fits(cfg, ParallelLayout(tp=2, dp=2, infer_tp=2)) is None  # a restart on 4 GPUs
    small = memory_fit.gpu_memory_check(_dims(), 40 * GIB, host_memory=1 << 40)
    why = small(cfg, ParallelLayout(tp=2, dp=4, infer_tp=2))
    assert why.startswith("TP2xPP1xDP4: startup needs") and "gpu_memory_utilization" in why


def test_a_local_judge_is_planned_while_it_answers_and_asleep_in_host_memory():
    """reward.judge.model_path: its bf16 replica (parameters counted by transformers here), one
    sequence's keys and values and its logits on the device while it judges, between the
    rollout and the scoring pass; in host memory otherwise."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.assets import tiny_char_judge_dir

    folder = tiny_char_judge_dir()
    with torch.device("meta"):
        judge = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    params = sum(p.numel() for p in judge.parameters())  # untied: the LM head counts apart
    c = judge.config
    head_dim = c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2 * 4096  # bf16, 4096 tokens
    logits = 2 * c.vocab_size * 4
    pf = _check(f"reward.judge.model_path={folder}", "reward.judge.max_length=4096")
    items = _items(pf, "judging")
    assert items["judge"] == 2 * params + kv + logits
    resident = ("weights", "grads", "optimizer", "reference", "reserve")
    assert {k: items[k] for k in resident} == {k: _items(pf, "scoring")[k] for k in resident}
    assert "activations" not in items and "rollout" not in items
    host = pf.host.ranks[(0, 0)]
    assert host["training"]["judge_asleep"] == host["rollout"]["judge_asleep"] == 2 * params
    assert "judging" not in {p.name for p in _check().phases}  # no judge, no phase


def test_the_recorded_routes_of_an_moe_rollout_are_planned_in_host_memory():
    """An MoE policy whose rollout records each token's experts (the HF backend; actor.
    router_replay on or off): int16 per token, layer and top-k slot for the rank's rollout, held
    for the step, and during the data-parallel re-deal every rank's on each rank; none with
    vLLM, which records none yet, nor for a dense model."""
    dims = resolve_model("Qwen3-30B-A3B")[1]  # 48 layers, top-8
    recipe = load_config("configs/grpo_qwen3_30b_a3b.yaml", ["rollout.engine.backend=hf"])
    pf = preflight(recipe, dims, HW, GPU, suggest=False)
    dp = 2  # TP4 x DP2 (EP2) on 8 GPUs
    sequences = 1024 * 5 // dp  # the rank's share of the rollout: prompts x rollout.sampling.n
    routes = sequences * (512 + 1024) * 48 * 8 * 2
    host = pf.host.ranks[(0, 0)]
    assert host["training"]["routes"] == host["rollout"]["routes"] == dp * routes
    alone = preflight(
        load_config(
            "configs/grpo_qwen3_30b_a3b.yaml",
            ["rollout.engine.backend=hf", "actor.balance_dp_tokens=false"],
        ),
        dims,
        HW,
        GPU,
        suggest=False,
    )
    assert alone.host.ranks[(0, 0)]["training"]["routes"] == routes
    vllm = preflight(load_config("configs/grpo_qwen3_30b_a3b.yaml"), dims, HW, GPU, suggest=False)
    assert "routes" not in vllm.host.ranks[(0, 0)]["training"]
    dense = _check("rollout.engine.backend=hf")
    assert "routes" not in dense.host.ranks[(0, 0)]["training"]
