"""Model families (megarl.models.families): the built-in families, Qwen3's tensor map against its HF
files, a family added through a spec alone, and the errors for architectures megarl lacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.errors import ConfigError, UnsupportedModelError
from megarl.models.dims import ModelDims, read_hf_config
from megarl.models.families import families, supported_architectures
from megarl.models.hf_map import (
    NameIndex,
    hf_to_megatron_shard,
    megatron_shards_to_hf,
    tensor_maps,
)
from megarl.models.safetensors_io import SafetensorsReader
from megarl.plan.known_models import resolve_model
from megarl.plan.params import layer_params
from megarl.weights.execute import hf_output_shapes
from megarl.weights.reshard_schedule import schedule_reshard
from megarl.weights.tensor_list import actor_planned_tensors
from tests import fake_family
from tests.assets import tiny_qwen2_dir, tiny_qwen3_dir, tiny_qwen3_tied_dir
from tests.import_graph import imports, modules

pytestmark = pytest.mark.unit


def test_every_builtin_family_registers_its_architecture():
    assert supported_architectures() == {
        "Qwen2ForCausalLM": "qwen2",
        "LlamaForCausalLM": "llama",
        "Qwen3ForCausalLM": "qwen3",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "MixtralForCausalLM": "mixtral",
    }
    assert {f.name for f in families()} == {"qwen2", "llama", "qwen3", "qwen3_moe", "mixtral"}


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    cfg = {"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64}
    with pytest.raises(UnsupportedModelError) as err:
        ModelDims.from_hf_config(cfg)
    msg = str(err.value)
    assert "GPTNeoXForCausalLM" in msg
    for arch in ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg
    # `megarl plan` on such a config.json: a ConfigError (exit code 2) with the same list.
    (tmp_path / "config.json").write_text('{"architectures": ["GPTNeoXForCausalLM"]}')
    with pytest.raises(ConfigError, match="Qwen3ForCausalLM"):
        resolve_model(str(tmp_path))


def test_reshard_schedule_imports_nothing_of_models():
    path = modules()["megarl.weights.reshard_schedule"]
    targets = [imp.target for imp in imports("megarl.weights.reshard_schedule", path)]
    assert targets  # the check sees its imports
    assert not [t for t in targets if t.startswith("megarl.")], targets


@pytest.mark.parametrize("make_dir", [tiny_qwen3_dir, tiny_qwen3_tied_dir])
def test_qwen3_dims_from_its_config(make_dir):
    dims = ModelDims.from_pretrained(make_dir())
    assert dims.family == "qwen3" and dims.qk_layernorm and not dims.qkv_bias
    assert dims.head_dim == 32 != dims.hidden_size // dims.num_attention_heads
    assert dims.tie_word_embeddings == (make_dir is tiny_qwen3_tied_dir)
    opts = dims.model_family.megatron_options(dims)
    assert opts["qk_layernorm"] is True and opts["kv_channels"] == 32
    assert opts["add_qkv_bias"] is False
    assert dims.model_family.layer_spec_options() == {"qk_layernorm": True}
    # Parameter count = the sum over the HF tensors (tied: the embedding counted once).
    reader = SafetensorsReader(make_dir())
    assert dims.num_parameters == sum(reader.read(n).numel() for n in reader.names())


def _round_trip(model_dir: Path, dims: ModelDims, tp: int) -> set[str]:
    """Each map's TP shards from the HF files, back to HF: bit-identical; returns the HF names."""
    reader = SafetensorsReader(model_dir)
    seen: set[str] = set()
    for layer in range(dims.num_layers):
        index = NameIndex(dims)
        for tm in tensor_maps(dims):
            tm2, hf_names = index.lookup(tm.megatron.format(layer=layer))
            assert tm2 == tm
            shards = [hf_to_megatron_shard(tm, hf_names, reader, dims, r, tp) for r in range(tp)]
            # The spec's shapes are what the HF files give, whole and per TP rank.
            full = shards[0] if tm.tp_dim is None else torch.cat(shards, tm.tp_dim)
            assert tuple(full.shape) == tm.shape, tm.megatron
            assert all(tuple(s.shape) == tm.shard_shape(tp) for s in shards), tm.megatron
            for hf_name, tensor in megatron_shards_to_hf(tm, hf_names, shards, dims):
                assert torch.equal(tensor, reader.read(hf_name)), hf_name
                seen.add(hf_name)
    return seen


@pytest.mark.parametrize("make_dir", [tiny_qwen3_dir, tiny_qwen3_tied_dir])
@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_tensor_map_round_trips_its_hf_tensors(make_dir, tp):
    model_dir = make_dir()
    dims = ModelDims.from_pretrained(model_dir)
    seen = _round_trip(model_dir, dims, tp)
    names = set(SafetensorsReader(model_dir).names())
    assert seen == names | ({"model.embed_tokens.weight"} if dims.tie_word_embeddings else set())
    assert "model.layers.3.self_attn.q_norm.weight" in seen
    _, hf = NameIndex(dims, layer_offset=2).lookup(
        "decoder.layers.1.self_attention.k_layernorm.weight"
    )
    assert hf == ("model.layers.3.self_attn.k_norm.weight",)


def test_known_qwen3_models_plan_with_their_published_sizes():
    name, dims = resolve_model("Qwen/Qwen3-8B")
    assert name == "Qwen3-8B" and dims.family == "qwen3" and dims.qk_layernorm
    assert not dims.tie_word_embeddings and dims.head_dim == 128
    assert 8.1e9 < dims.num_parameters < 8.3e9  # published: 8.2B
    _, small = resolve_model("Qwen3-0.6B")
    assert small.tie_word_embeddings and 0.58e9 < small.num_parameters < 0.61e9  # 0.6B
    # The planner's per-layer count includes the q/k norms: layers + embeddings = the whole.
    split, replicated, _ = layer_params(dims, 1)
    embed = dims.vocab_size * dims.hidden_size * 2
    assert dims.num_layers * (split + replicated) + embed + dims.hidden_size == dims.num_parameters


# -- a family added through a spec alone ---------------------------------------------------------


@pytest.fixture
def fake_dir(tmp_path):
    with fake_family.registered():
        yield fake_family.fake_dense_dir(tmp_path / "fake", tiny_qwen2_dir())


def test_fake_family_is_read_mapped_and_round_trips(fake_dir):
    dims = ModelDims.from_pretrained(fake_dir)
    qwen2 = ModelDims.from_pretrained(tiny_qwen2_dir())
    assert dims.family == "fakedense" and dims.architecture == fake_family.ARCH
    assert {**dims.__dict__, "family": "", "architecture": ""} == {
        **qwen2.__dict__,
        "family": "",
        "architecture": "",
    }
    assert "FakeDenseForCausalLM" in supported_architectures()
    for tp in (1, 2):
        assert _round_trip(fake_dir, dims, tp) == set(SafetensorsReader(fake_dir).names())
    with pytest.raises(UnsupportedModelError, match="roles"):
        tensor_maps(dims, "critic")


def test_fake_family_reshard_schedule_delivers_every_hf_tensor(fake_dir):
    dims = ModelDims.from_pretrained(fake_dir)
    reader = SafetensorsReader(fake_dir)
    specs = actor_planned_tensors(dims, [2, 2])
    plan = schedule_reshard(specs, tp=2, pp=2, dp=1, infer_tp=2, bucket_bytes=64 << 10)
    assert hf_output_shapes(plan, dims) == {n: reader.shape(n) for n in reader.names()}
    for rank in range(4):
        assert plan.recv_bytes(rank) == plan.min_recv_bytes(rank) > 0


def test_fake_family_is_unknown_once_unregistered(fake_dir):
    cfg = read_hf_config(fake_dir)
    fake_family.unregister_family(fake_family.FAMILY.name)
    with pytest.raises(UnsupportedModelError, match="FakeDenseForCausalLM"):
        ModelDims.from_hf_config(cfg)
