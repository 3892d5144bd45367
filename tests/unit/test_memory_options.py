"""Memory and scale settings: sequence parallelism's config, resolution, padding and norms."""

from __future__ import annotations

import pytest
import torch

from megarl.config import choices, load_config
from megarl.errors import ConfigError, LayoutError
from megarl.models.build import resolve_sequence_parallel
from megarl.models.forward import pad_to_multiple

pytestmark = pytest.mark.unit

BASE = ["model.path=/models/x", "data.train_files=[a.parquet]"]


def test_sequence_parallel_defaults_on_exactly_when_tp_above_one():
    assert load_config(overrides=BASE).parallel.sequence_parallel is None
    assert resolve_sequence_parallel(None, 1) is False
    assert resolve_sequence_parallel(None, 2) is True
    assert resolve_sequence_parallel(False, 4) is False
    assert load_config(overrides=[*BASE, "parallel.tp=2", "parallel.sequence_parallel=false"])


def test_sequence_parallel_without_tp_is_refused_before_launch():
    with pytest.raises(
        ConfigError, match=r"sequence_parallel=true needs tensor parallelism.*tp > 1"
    ):
        load_config(overrides=[*BASE, "parallel.sequence_parallel=true"])
    with pytest.raises(LayoutError, match=r"parallel\.tp > 1"):
        resolve_sequence_parallel(True, 1)


def test_pad_to_multiple_pads_right_with_zeros_only_when_needed():
    ids = torch.arange(1, 14, device="cpu").reshape(1, 13)
    padded = pad_to_multiple(ids, 4)
    assert padded.shape == (1, 16)
    assert torch.equal(padded[:, :13], ids) and padded[0, 13:].tolist() == [0, 0, 0]
    assert pad_to_multiple(ids, 1) is ids


def test_local_norm_carries_the_sequence_parallel_tag():
    from types import SimpleNamespace

    from megarl.models.norm import SequenceParallelTorchNorm

    config = SimpleNamespace(
        normalization="RMSNorm", layernorm_zero_centered_gamma=False, sequence_parallel=True
    )
    norm = SequenceParallelTorchNorm(config, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert all(p.sequence_parallel for p in norm.parameters())
    config.sequence_parallel = False
    assert not any(p.sequence_parallel for p in SequenceParallelTorchNorm(config, 8).parameters())


def test_recompute_kinds_map_to_megatron_settings():
    from megarl.models.build import recompute_settings

    assert recompute_settings("none") == {}
    assert recompute_settings("selective") == {
        "recompute_granularity": "selective",
        "recompute_modules": ["core_attn"],
    }
    assert recompute_settings("full", 3) == {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 3,
    }
    cfg = load_config(overrides=[*BASE, "model.recompute=selective"])
    assert (cfg.model.recompute, cfg.model.recompute_num_layers) == ("selective", 1)


def test_recompute_bad_values_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"model.recompute='partial' is not one of"):
        load_config(overrides=[*BASE, "model.recompute=partial"])
    with pytest.raises(ConfigError, match=r"recompute_num_layers=0 must be >= 1"):
        load_config(overrides=[*BASE, "model.recompute=full", "model.recompute_num_layers=0"])


def test_planner_uses_the_config_recompute_names_and_follows_sequence_parallel():
    from megarl.models.dims import ModelDims
    from megarl.parallel import ParallelLayout
    from megarl.plan import CPU_FP32, KNOWN_MODELS, Options, Workload, estimate_memory
    from megarl.plan.search import Filters, _knobs

    kinds = {o.recompute for o in _knobs(Filters(), flash_attention=False)}
    assert kinds == set(choices("model.recompute"))
    assert {o.recompute for o in _knobs(Filters(), flash_attention=True)} == {"none", "full"}
    dims = ModelDims.from_hf_config(KNOWN_MODELS["Qwen2.5-0.5B"])
    layout = ParallelLayout(tp=2)
    work = Workload(seq_len=1024, micro_batch=2, global_batch=2, reference=False, rollout=False)

    def activations(**kw) -> int:
        est = estimate_memory(dims, layout, work, CPU_FP32, Options(**kw), reserve=0)
        return est.worst.phase_items["forward-backward"]["activations"]

    none, full = activations(recompute="none"), activations(recompute="full")
    assert full < none
    # Sequence parallelism (the default at tp 2) splits the hidden-size activations.
    assert activations(recompute="none", sequence_parallel=False) > none


def test_context_parallel_refused_on_cpu_and_when_it_does_not_divide_the_budget(monkeypatch):
    from megarl import backends

    cfg = load_config(overrides=[*BASE, "parallel.cp=2"])  # 512 + 512 is a multiple of 4
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"parallel.cp=2: context parallelism needs Transformer"):
        _check_backends(cfg)
    _check_backends(load_config(overrides=BASE))  # cp=1 passes
    with pytest.raises(ConfigError, match=r"parallel.cp=3 does not divide the sequence budget.*"):
        load_config(overrides=[*BASE, "parallel.cp=3", "rollout.sampling.max_response_length=500"])
    with pytest.raises(ConfigError, match=r"reward_model.max_length = 1000 must be a multiple"):
        load_config(
            overrides=[
                *BASE,
                "parallel.cp=8",
                "trainer.kind=reward_model",
                "reward_model.max_length=1000",
            ]
        )
    with pytest.raises(ConfigError, match=r"parallel.cp=0 must be >= 1"):
        load_config(overrides=[*BASE, "parallel.cp=0"])
    # Where Transformer Engine could run it, megarl still refuses: it does not build CP yet.
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "installed", lambda package: True)
    with pytest.raises(ConfigError, match=r"does not build context-parallel models yet"):
        backends.check_context_parallel(2, "auto")


def test_optimizer_offload_range_and_cpu_refusal(monkeypatch):
    from megarl import backends

    for bad in ("-0.1", "1.5"):
        with pytest.raises(
            ConfigError, match=rf"actor.optimizer_offload={bad} must be in \[0, 1\]"
        ):
            load_config(overrides=[*BASE, f"actor.optimizer_offload={bad}"])
    cfg = load_config(overrides=[*BASE, "actor.optimizer_offload=0.5"])
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"needs CUDA.*set actor.optimizer_offload=0"):
        _check_backends(cfg)
    backends.check_optimizer_offload(0.0)


def _check_backends(cfg) -> None:
    """megarl.run.checks' call of check_backends for ``cfg``."""
    from megarl import backends

    backend = backends.rollout_backend(cfg.trainer.kind, cfg.rollout.engine.backend)
    backends.check_backends(cfg.model, cfg.actor, cfg.parallel, backend)
