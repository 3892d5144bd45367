"""The GPU defaults decided on a CPU: what a CUDA / Transformer Engine machine gets where the config
says nothing, what it refuses before launch, and how many processes `megarl train` starts."""

from __future__ import annotations

import os

import pytest

from megarl import backends
from megarl.config import load_config, model_dtype
from megarl.errors import ConfigError
from megarl.gpu_defaults import (
    MAX_CONNECTIONS,
    Target,
    check_for_target,
    default_nproc_per_node,
    grad_reduce_overlap,
    kernel_options,
    launch_env,
    transformer_impl,
)

BASE = ["model.path=/models/x", "data.train_files=[a.parquet]"]
CPU = Target(cuda=False)
CUDA_TE = Target(cuda=True, transformer_engine=True, local_gpus=8)
CUDA_TE_APEX = Target(cuda=True, transformer_engine=True, wgrad_fusion_kernel=True, local_gpus=8)
CUDA_ONLY = Target(cuda=True, local_gpus=4)  # no Transformer Engine installed


def _cfg(*overrides: str):
    return load_config(overrides=[*BASE, *overrides])


def _check_for_target(cfg, target: Target) -> None:
    check_for_target(cfg.model, cfg.actor, target)


def _launch_env(cfg, target: Target) -> dict[str, str]:
    return launch_env(cfg.model, cfg.parallel, cfg.actor, target)


def _nproc_per_node(cfg, target: Target) -> int:
    return default_nproc_per_node(cfg.parallel, cfg.rollout, target)


def test_dtype_is_bf16_on_cuda_where_the_config_says_nothing():
    cfg = _cfg()
    assert cfg.model.dtype == "auto"
    assert model_dtype(cfg.model, cuda=True) == "bfloat16"
    assert model_dtype(cfg.model, cuda=False) == "float32"
    for given in ("float32", "bfloat16"):  # a dtype the config names is kept everywhere
        assert model_dtype(_cfg(f"model.dtype={given}").model, cuda=True) == given
        assert model_dtype(_cfg(f"model.dtype={given}").model, cuda=False) == given
    with pytest.raises(ConfigError, match=r"model.dtype='fp16' is not one of \['auto'"):
        _cfg("model.dtype=fp16")


@pytest.mark.parametrize(
    ("requested", "target", "lora", "want"),
    [
        ("auto", CUDA_TE, False, "transformer_engine"),
        ("auto", CUDA_TE, True, "local"),  # LoRA wraps megatron's own linears
        ("auto", CUDA_ONLY, False, "local"),
        ("auto", CPU, False, "local"),
        ("local", CUDA_TE, False, "local"),
        ("transformer_engine", CUDA_TE, False, "transformer_engine"),
    ],
)
def test_layer_implementation_per_machine(requested, target, lora, want):
    assert transformer_impl(requested, target, lora=lora) == want


def test_transformer_engine_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="needs CUDA"):
        transformer_impl("transformer_engine", CPU)
    with pytest.raises(ConfigError, match=r"not installed.*no-build-isolation"):
        transformer_impl("transformer_engine", CUDA_ONLY)


def test_fused_kernels_and_overlap_follow_transformer_engine():
    te = kernel_options("transformer_engine", CUDA_TE)
    assert (te.apply_rope_fusion, te.overlap_grad_reduce) == (True, True)
    assert te.bias_activation_fusion and te.masked_softmax_fusion and te.bias_dropout_fusion
    # megatron's output layer needs apex's fused_weight_gradient_mlp_cuda for the fusion
    assert te.gradient_accumulation_fusion is False
    assert kernel_options("transformer_engine", CUDA_TE_APEX).gradient_accumulation_fusion
    local = kernel_options("local", CUDA_ONLY)
    assert local.bias_activation_fusion  # CUDA kernels, not TE's
    assert not (local.apply_rope_fusion or local.gradient_accumulation_fusion)
    assert not local.overlap_grad_reduce
    cpu = kernel_options("local", CPU)
    assert not any(vars(cpu).values())  # nothing fused on a CPU
    assert set(te.transformer_config()) == {
        "bias_activation_fusion",
        "masked_softmax_fusion",
        "bias_dropout_fusion",
        "apply_rope_fusion",
        "gradient_accumulation_fusion",
    }
    assert grad_reduce_overlap("transformer_engine", cuda=True)
    assert not grad_reduce_overlap("transformer_engine", cuda=False)
    assert not grad_reduce_overlap("local", cuda=True)


def test_experts_run_as_grouped_gemm_with_transformer_engine_on_cuda():
    from megarl.plan.known_models import resolve_model

    assert kernel_options("transformer_engine", CUDA_TE).moe_grouped_gemm
    assert not kernel_options("local", CUDA_ONLY).moe_grouped_gemm  # sequential experts
    assert not kernel_options("local", CPU).moe_grouped_gemm
    _, moe = resolve_model("Qwen3-30B-A3B")
    family = moe.model_family
    grouped = kernel_options("transformer_engine", CUDA_TE).moe_grouped_gemm
    assert family.layer_spec_options(moe, grouped)["moe_grouped_gemm"] is True
    assert family.layer_spec_options(moe)["moe_grouped_gemm"] is False


def test_optimizer_offload_without_transformer_engine_is_refused_naming_the_fix():
    with pytest.raises(ConfigError) as err:
        _check_for_target(_cfg("actor.optimizer_offload=1.0"), CUDA_ONLY)
    message = str(err.value)
    assert "precision-aware" in message and "actor.optimizer_offload=0" in message
    _check_for_target(_cfg("actor.optimizer_offload=1.0"), CUDA_TE)


def test_cuda_device_max_connections_where_megatron_needs_it():
    assert _launch_env(_cfg("parallel.tp=2"), CUDA_ONLY) == {MAX_CONNECTIONS: "1"}  # TP comms
    assert _launch_env(_cfg(), CUDA_TE) == {MAX_CONNECTIONS: "1"}  # overlapped grad reduce
    assert _launch_env(_cfg(), CUDA_ONLY) == {}  # TP1, local spec: nothing overlaps
    assert _launch_env(_cfg("parallel.tp=2"), CPU) == {}


def test_set_rank_env_keeps_a_users_value(monkeypatch):
    monkeypatch.setattr(backends, "this_machine", lambda: CUDA_TE)
    monkeypatch.delenv(MAX_CONNECTIONS, raising=False)
    assert _set_rank_env(_cfg("parallel.tp=2")) == {MAX_CONNECTIONS: "1"}
    assert os.environ[MAX_CONNECTIONS] == "1"
    monkeypatch.setenv(MAX_CONNECTIONS, "8")
    assert _set_rank_env(_cfg("parallel.tp=2")) == {}
    assert os.environ[MAX_CONNECTIONS] == "8"


def test_processes_per_node():
    assert _nproc_per_node(_cfg("parallel.tp=2"), CUDA_TE) == 8  # one per GPU, DP 4
    assert _nproc_per_node(_cfg("parallel.tp=2", "parallel.pp=2"), CPU) == 4
    # rollout.placement.mode=async on CPU: one trainer replica and the rollout group
    split = ("parallel.tp=2", "rollout.placement.mode=async", "parallel.rollout_ranks=2")
    assert _nproc_per_node(_cfg(*split), CPU) == 4
    assert _nproc_per_node(_cfg(*split), CUDA_TE) == 8  # the node's GPUs, split by rank


def test_fp32_with_transformer_engine_and_packing_is_refused_naming_the_fix():
    with pytest.raises(ConfigError) as err:
        _check_for_target(_cfg("model.dtype=float32"), CUDA_TE)
    message = str(err.value)
    assert "THD" in message and "model.dtype=bfloat16" in message
    assert "actor.packing=false" in message and "model.transformer_impl=local" in message
    _check_for_target(_cfg(), CUDA_TE)  # auto: bf16 on CUDA
    _check_for_target(_cfg("model.dtype=float32", "actor.packing=false"), CUDA_TE)
    _check_for_target(_cfg("model.dtype=float32", "model.transformer_impl=local"), CUDA_TE)
    _check_for_target(_cfg("model.dtype=float32"), CUDA_ONLY)  # no TE: the local spec packs
    _check_for_target(_cfg("model.dtype=float32"), CPU)


def test_check_backends_refuses_it_on_this_machine(monkeypatch):
    monkeypatch.setattr(backends, "this_machine", lambda: CUDA_TE)
    with pytest.raises(ConfigError, match="THD"):
        _check_backends(_cfg("model.dtype=float32"))


def test_rollout_settings():
    cfg = _cfg()
    assert (cfg.rollout.engine.max_num_seqs, cfg.rollout.sampling.per_request_seeds) == (256, True)
    with pytest.raises(ConfigError, match=r"rollout\.engine\.max_num_seqs must be >= 1"):
        _cfg("rollout.engine.max_num_seqs=0")


class _Recorder:
    """vLLM's LLM.generate, recording the seed of every request."""

    def __init__(self):
        self.seeds: list[int | None] = []

    def generate(self, prompts, params, use_tqdm=False):
        self.seeds += params
        return []


@pytest.mark.parametrize(("per_request", "temperature"), [(True, 1.0), (False, 1.0), (True, 0.0)])
def test_request_seeds_or_the_batched_sampler(per_request, temperature):
    from megarl.rollout.rollout_types import SamplingConfig
    from megarl.rollout.seeds import sequence_seed
    from megarl.rollout.vllm_rollout import VLLMRollout

    engine = object.__new__(VLLMRollout)  # no vLLM: only the request building runs
    engine.asleep = False
    engine.weights_loaded = True  # as after the first reshard
    engine.llm = _Recorder()
    engine.sampling_params = lambda sampling, seed, max_tokens=None: seed
    sampling = SamplingConfig(temperature=temperature, seed=7, per_request_seeds=per_request)
    engine.generate([[1, 2], [3], [4]], sampling, seed_offset=10)
    # outside a run: the streams of samples 10, 11, 12 of the seed's rollout 0, one each
    own = [sequence_seed(7, 0, 10 + i) for i in range(3)]
    want = own if per_request and temperature > 0 else [None, None, None]
    assert engine.llm.seeds == want
    # a multi-turn turn's own request seeds, under the same rule
    engine.llm = _Recorder()
    engine.generate([[1, 2], [3], [4]], sampling, seeds=[5, 3, 9])
    assert engine.llm.seeds == ([5, 3, 9] if per_request and temperature > 0 else [None] * 3)


def test_engine_seed_differs_per_engine_without_request_seeds():
    from megarl.trainer.rollout_assembly import engine_config

    # colocated TP2 ranks 0-3 (and a rollout group's ranks) hold engines rank // infer_tp
    def seed(cfg, engine_index: int) -> int:
        return engine_config(cfg.model, cfg.data, cfg.rollout, cfg.trainer.seed, engine_index).seed

    seeded = _cfg("trainer.seed=3")
    assert {seed(seeded, r // 2) for r in range(4)} == {3}
    batched = _cfg("trainer.seed=3", "rollout.sampling.per_request_seeds=false")
    assert [seed(batched, r // 2) for r in range(4)] == [3, 3, 4, 4]


def test_model_options_take_bf16_on_cuda(monkeypatch):
    import torch

    from megarl.run.trainable import model_options

    def options(*overrides: str):
        cfg = _cfg(*overrides)
        return model_options(cfg.model, cfg.parallel, cfg.actor.lora)

    assert options().dtype == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert options().dtype == torch.bfloat16
    assert options("model.dtype=float32").dtype == torch.float32


def test_train_starts_one_process_per_gpu_on_cuda(monkeypatch, tmp_path):
    from megarl import cli, dry_run, launch
    from megarl.cluster import local
    from tests.assets import tiny_qwen2_dir

    monkeypatch.setattr(backends, "this_machine", lambda: CUDA_TE)
    monkeypatch.setattr(dry_run, "this_machine", lambda: CUDA_TE)
    launched = []

    def fake_torchrun(module, args, nproc, **kwargs):
        launched.append(nproc)
        return 0

    monkeypatch.setattr(launch, "run_torchrun", fake_torchrun)
    monkeypatch.setattr(local, "run_torchrun", fake_torchrun)  # the local launcher's own name
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"prompt": [[{"role": "user", "content": "hi"}]] * 8, "data_source": ["t"] * 8}),
        tmp_path / "t.parquet",
    )
    yaml = tmp_path / "run.yaml"
    yaml.write_text(
        f"model:\n  path: {tiny_qwen2_dir()}\ndata:\n  train_files: [{tmp_path}/t.parquet]\n"
        "  train_batch_size: 8\nactor:\n  ppo_mini_batch_size: 8\nrollout:\n  backend: hf\n"
        "reward:\n  custom_fn: megarl.rewards.toy:vowel_rate\n"  # prompts without answers
    )
    assert cli.main(["train", str(yaml), "--no-preflight"]) == 0
    assert launched == [8]  # the 8 local GPUs: DP 8 at TP1
    # on CUDA the memory preflight runs first: GPUs far too small stop the launch (exit 2)
    assert cli.main(["train", str(yaml), "--gpu-memory", "5GiB"]) == 2
    assert launched == [8]
    assert cli.main(["train", str(yaml), "--gpu-memory", "5GiB", "--no-preflight"]) == 0
    assert launched == [8, 8]
    monkeypatch.setattr(backends, "this_machine", lambda: CPU)
    monkeypatch.setattr(dry_run, "this_machine", lambda: CPU)
    assert cli.main(["train", str(yaml), "parallel.tp=2", "actor.ppo_mini_batch_size=8"]) == 0
    assert launched == [8, 8, 2]  # CPU: tp * pp


def _check_backends(cfg) -> None:
    """megarl.run.checks' call of check_backends for ``cfg``."""
    backend = backends.rollout_backend(cfg.trainer.kind, cfg.rollout.engine.backend)
    backends.check_backends(cfg.model, cfg.actor, cfg.parallel, backend)


def _set_rank_env(cfg) -> dict[str, str]:
    return backends.set_rank_env(cfg.model, cfg.parallel, cfg.actor)
