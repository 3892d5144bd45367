"""The GPU path's settings and seams, on the CPU: bad input refused before launch, both megatron
namings (local and Transformer Engine layer specs) through every name map, and the Hugging Face
rollout backend against transformers itself."""

from __future__ import annotations

import pytest
import torch

from megarl import backends
from megarl.config import choices, load_config
from megarl.errors import ConfigError
from megarl.models.dims import ModelDims
from megarl.models.hf_map import (
    TE_NORM_NAMES,
    NameIndex,
    hf_to_megatron_shard,
    state_dict_to_naming,
    tensor_maps,
    to_naming,
)
from megarl.models.safetensors_io import SafetensorsReader
from megarl.rollout.engine import ROLLOUT_BACKENDS
from tests.assets import tiny_llama_dir, tiny_mixtral_dir, tiny_qwen2_dir, tiny_qwen3_moe_dir

BASE = ["model.path=/models/x", "data.train_files=[a.parquet]"]

# -- bad input, before launch ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("rollout.engine.sleep_level=3", r"rollout.engine.sleep_level=3 is not one of \[1, 2\]"),
        ("rollout.engine.sleep_level=0", r"rollout.engine.sleep_level=0 is not one of \[1, 2\]"),
        (
            "rollout.engine.gpu_memory_utilization=0",
            r"gpu_memory_utilization=0.0 must be in \(0, 1\]",
        ),
        (
            "rollout.engine.gpu_memory_utilization=1.2",
            r"gpu_memory_utilization=1.2 must be in \(0, 1\]",
        ),
        (
            "rollout.engine.backend=sglang",
            r"rollout.engine.backend='sglang' is not one of \['vllm', 'hf'\]",
        ),
        ("rollout.engine.reshard_mode=half", r"rollout.engine.reshard_mode='half' is not one of"),
        ("model.transformer_impl=apex", r"model.transformer_impl='apex' is not one of"),
    ],
)
def test_bad_gpu_settings_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[*BASE, override])


def test_gpu_settings_defaults_and_bounds():
    cfg = load_config(overrides=BASE)
    r = cfg.rollout.engine
    # sleep level 2: the reshard refills every weight, so vLLM drops them while it sleeps
    assert (r.backend, r.gpu_memory_utilization, r.sleep_level) == ("vllm", 0.5, 2)
    assert r.reshard_mode == "auto"
    assert cfg.model.transformer_impl == "auto"
    cfg = load_config(
        overrides=[*BASE, "rollout.engine.gpu_memory_utilization=1", "rollout.engine.sleep_level=1"]
    )
    assert (cfg.rollout.engine.gpu_memory_utilization, cfg.rollout.engine.sleep_level) == (1.0, 1)


def test_vllm_backend_without_vllm_names_the_fix(monkeypatch):
    monkeypatch.setattr(backends, "installed", lambda package: package != "vllm")
    cfg = load_config(overrides=BASE)
    with pytest.raises(ConfigError, match=r"vLLM is not installed.*rollout.engine.backend=hf"):
        _check_backends(cfg)
    _check_backends(load_config(overrides=[*BASE, "rollout.engine.backend=hf"]))
    # a reward-model run does not roll out
    _check_backends(load_config(overrides=[*BASE, "trainer.kind=reward_model"]))


def test_every_rollout_backend_the_config_accepts_has_an_engine():
    assert set(ROLLOUT_BACKENDS) == set(choices("rollout.engine.backend"))


def test_cli_refuses_vllm_without_vllm_before_launch(monkeypatch, tmp_path, capsys):
    from megarl import cli, launch

    monkeypatch.setattr(backends, "installed", lambda package: package != "vllm")
    launched = []
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: launched.append(a) or 0)
    yaml = tmp_path / "run.yaml"
    yaml.write_text(
        f"model:\n  path: {tiny_qwen2_dir()}\ndata:\n  train_files: [{tmp_path}/t.parquet]\n"
        "  train_batch_size: 4\nactor:\n  ppo_mini_batch_size: 4\n"
    )
    assert cli.main(["train", str(yaml), "--nproc-per-node", "1"]) == 2
    assert "vLLM is not installed" in capsys.readouterr().err and not launched


def test_transformer_engine_requests(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"needs CUDA.*model.transformer_impl=local"):
        backends.resolve_transformer_impl("transformer_engine")
    assert backends.resolve_transformer_impl("auto") == "local"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "installed", lambda package: False)
    with pytest.raises(
        ConfigError, match=r"Transformer Engine is not installed.*no-build-isolation"
    ):
        backends.resolve_transformer_impl("transformer_engine")
    assert backends.resolve_transformer_impl("auto") == "local"
    monkeypatch.setattr(backends, "installed", lambda package: True)
    assert backends.resolve_transformer_impl("auto") == "transformer_engine"
    assert backends.resolve_transformer_impl("local") == "local"


def test_layer_spec_refuses_te_on_cpu():
    from megarl.models.build import layer_spec

    with pytest.raises(ConfigError, match="needs CUDA"):
        layer_spec("transformer_engine")


# -- both megatron namings ------------------------------------------------------------------------


def _local_state_dict(model_dir) -> tuple[ModelDims, dict[str, torch.Tensor]]:
    """A local-spec model's parameters (stage-local names, TP1), made from the HF folder."""
    dims = ModelDims.from_pretrained(model_dir)
    reader = SafetensorsReader(model_dir)
    index = NameIndex(dims)
    state = {}
    for tm in tensor_maps(dims):
        for layer in range(dims.num_layers) if tm.per_layer else [None]:
            for expert in range(dims.num_experts) if tm.per_expert else [None]:
                name = tm.megatron.format(layer=layer, expert=expert)
                hf = index.lookup(name)[1]
                state[name] = hf_to_megatron_shard(tm, hf, reader, dims, 0, 1)
    return dims, state


@pytest.mark.parametrize(
    "model_dir", [tiny_qwen2_dir, tiny_llama_dir, tiny_qwen3_moe_dir, tiny_mixtral_dir]
)
def test_state_dict_to_te_naming_and_back_is_bit_identical(model_dir):
    dims, local = _local_state_dict(model_dir())
    te = state_dict_to_naming(local, "transformer_engine")
    if dims.is_moe:  # on CUDA the TE spec groups each layer's experts (TEGroupedMLP)
        grouped = [k for k in te if ".mlp.experts.linear_fc" in k]
        assert len(grouped) == 2 * dims.num_layers * dims.num_experts
        assert f"decoder.layers.1.mlp.experts.linear_fc1.weight{dims.num_experts - 1}" in te
        assert not [k for k in te if ".local_experts." in k]
    norms = [k for k in te if k.endswith("layer_norm_weight")]
    assert len(norms) == 2 * dims.num_layers
    assert not [k for k in te if k.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight"))]
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.final_layernorm.weight" in te  # outside the layers: one name in both specs
    back = state_dict_to_naming(te, "local")
    assert list(back) == list(local)
    assert all(back[k] is local[k] for k in local)
    # the index resolves both namings to the same HF tensors
    index = NameIndex(dims, layer_offset=1)
    for name in local:
        assert index.lookup(name) == index.lookup(to_naming(name, "transformer_engine"))


def test_te_names_keep_dist_checkpoint_keys():
    from megarl.checkpoint.keys import dist_checkpoint_key

    for local, te in TE_NORM_NAMES.items():
        template = "decoder.layers.{layer}."
        assert dist_checkpoint_key(template + local) == "decoder.layers." + te
        assert to_naming(template + local, "transformer_engine") == template + te
    with pytest.raises(ValueError, match="unknown megatron naming"):
        to_naming("decoder.layers.0.input_layernorm.weight", "te")


class _NamedParams:
    """Just enough of a model for megarl.models.loading.mapped_parameters."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self._state = state

    def named_parameters(self):
        return iter(self._state.items())


@pytest.mark.parametrize("model_dir", [tiny_qwen2_dir, tiny_qwen3_moe_dir])
def test_reshard_takes_te_named_parameters(model_dir):
    from megarl.weights.execute import local_spec_tensors
    from megarl.weights.tensor_list import actor_planned_tensors

    dims, local = _local_state_dict(model_dir())
    specs = actor_planned_tensors(dims, [dims.num_layers])
    te = state_dict_to_naming(local, "transformer_engine")
    from_local = local_spec_tensors(_NamedParams(local), dims, 0, specs)
    from_te = local_spec_tensors(_NamedParams(te), dims, 0, specs)
    assert from_local.keys() == from_te.keys()
    assert len(from_local) == len(specs)
    assert all(torch.equal(from_local[i], from_te[i]) for i in from_local)


# -- the Hugging Face rollout backend ---------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_rollout():
    from megarl.rollout.hf_rollout import HFRollout
    from megarl.rollout.rollout_types import EngineConfig

    return HFRollout(tiny_qwen2_dir(), 1, EngineConfig(dtype="float32"))


def _reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def _greedy_and_logprobs(model, prompt, steps):
    ids = torch.tensor([prompt])
    for _ in range(steps):
        ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    new = ids[0, len(prompt) :]
    return new.tolist(), logp[len(prompt) - 1 :].gather(1, new[:, None])[:, 0]


PROMPTS = [[5, 17, 99, 3], [42, 8], [7, 7, 7, 1, 2, 250]]


def test_hf_rollout_greedy_and_logprobs_equal_transformers(hf_rollout):
    from megarl.rollout.rollout_types import SamplingConfig

    ref = _reference(tiny_qwen2_dir())
    out = hf_rollout.generate(
        PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=6, stop_token_ids=())
    )
    assert out.prompt_index == [0, 1, 2] and out.finish_reasons == ["length"] * 3
    for prompt, tokens, lps in zip(PROMPTS, out.token_ids, out.logprobs, strict=True):
        want, want_lp = _greedy_and_logprobs(ref, prompt, 6)
        assert tokens == want
        assert (torch.tensor(lps) - want_lp).abs().max().item() < 1e-5


def test_hf_rollout_seeds_and_stop_tokens(hf_rollout):
    from megarl.rollout.rollout_types import SamplingConfig

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=5, n=3, stop_token_ids=(), seed=4)
    state = torch.get_rng_state()
    a = hf_rollout.generate(PROMPTS[:2], sampling)
    assert torch.equal(state, torch.get_rng_state())  # the trainer's RNG is left alone
    b = hf_rollout.generate(PROMPTS[:2], sampling)
    c = hf_rollout.generate(PROMPTS[:2], sampling, seed_offset=10)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert a.prompt_index == [0, 0, 0, 1, 1, 1]
    # a stop token ends the response (kept, as vLLM keeps it)
    first = a.token_ids[0][1]
    stopped = hf_rollout.generate(
        PROMPTS[:1], SamplingConfig(**{**sampling.__dict__, "stop_token_ids": (first,)})
    )
    row = stopped.token_ids[0]
    assert row == a.token_ids[0][:2] and stopped.finish_reasons[0] == "stop"
    assert len(stopped.logprobs[0]) == len(row)


def test_hf_rollout_follows_a_weight_update(hf_rollout, tmp_path):
    from megarl.rollout.rollout_types import SamplingConfig
    from megarl.tools.testing.assets import randomize_

    greedy = SamplingConfig(temperature=0.0, max_new_tokens=6, stop_token_ids=())
    other = _reference(tiny_qwen2_dir())
    randomize_(other, 77)
    weights = [(n, p.detach().clone()) for n, p in other.named_parameters()]
    bad = [(weights[0][0], weights[0][1][:-1])]
    with pytest.raises(ValueError, match="has shape"):
        hf_rollout.update_weights(bad)
    hf_rollout.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        hf_rollout.generate(PROMPTS, greedy)
    hf_rollout.wake_up(["weights"])
    hf_rollout.update_weights(weights)
    hf_rollout.after_weight_update()
    hf_rollout.wake_up(["kv_cache"])
    out = hf_rollout.generate(PROMPTS, greedy)
    for prompt, tokens in zip(PROMPTS, out.token_ids, strict=True):
        assert tokens == _greedy_and_logprobs(other, prompt, 6)[0]
    original = _reference(tiny_qwen2_dir())
    assert out.token_ids != [_greedy_and_logprobs(original, p, 6)[0] for p in PROMPTS]


def _check_backends(cfg) -> None:
    """megarl.run.checks' call of check_backends for ``cfg``."""
    backend = backends.rollout_backend(cfg.trainer.kind, cfg.rollout.engine.backend)
    backends.check_backends(cfg.model, cfg.actor, cfg.parallel, backend)
