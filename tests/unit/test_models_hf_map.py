"""The HF <-> megatron name map and transforms, and the errors for bad checkpoints (no processes)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megarl.errors import CheckpointError, UnsupportedModelError
from megarl.models.dims import ModelDims, read_hf_config
from megarl.models.hf_map import NameIndex, hf_to_megatron_shard, megatron_shards_to_hf, tensor_maps
from megarl.models.safetensors_io import SafetensorsReader
from tests.assets import smollm2_dir, tiny_llama_dir, tiny_qwen2_dir


@pytest.mark.parametrize("make_dir", [tiny_qwen2_dir, tiny_llama_dir])
@pytest.mark.parametrize("tp", [1, 2])
def test_shards_round_trip_to_the_same_hf_tensors(make_dir, tp):
    model_dir = make_dir()
    dims = ModelDims.from_pretrained(model_dir)
    reader = SafetensorsReader(model_dir)
    seen = set()
    for layer in range(dims.num_layers):
        index = NameIndex(dims)
        for tm in tensor_maps(dims):
            name = tm.megatron.format(layer=layer)
            tm2, hf_names = index.lookup(name)
            assert tm2 == tm
            shards = [hf_to_megatron_shard(tm, hf_names, reader, dims, r, tp) for r in range(tp)]
            for hf_name, tensor in megatron_shards_to_hf(tm, hf_names, shards, dims):
                assert torch.equal(tensor, reader.read(hf_name)), hf_name
                seen.add(hf_name)
    assert seen == set(reader.names()) | (
        {"model.embed_tokens.weight"} if dims.tie_word_embeddings else set()
    )


def test_qkv_fusion_groups_queries_with_their_kv_head():
    dims = ModelDims.from_pretrained(tiny_qwen2_dir())  # 4 heads, 2 KV groups, head_dim 16
    reader = SafetensorsReader(tiny_qwen2_dir())
    tm, hf = NameIndex(dims).lookup("decoder.layers.0.self_attention.linear_qkv.weight")
    fused = hf_to_megatron_shard(tm, hf, reader, dims, 0, 1)
    q, k, v = (reader.read(n) for n in hf)
    # group 1 = query heads 2,3 then KV head 1
    group1 = fused[64:128]
    assert torch.equal(group1[:32], q[32:64])
    assert torch.equal(group1[32:48], k[16:32])
    assert torch.equal(group1[48:64], v[16:32])
    # TP rank 1 of 2 holds exactly group 1
    assert torch.equal(hf_to_megatron_shard(tm, hf, reader, dims, 1, 2), group1)


def test_layer_offset_maps_stage_local_to_global_index():
    dims = ModelDims.from_pretrained(tiny_qwen2_dir())
    _, hf = NameIndex(dims, layer_offset=2).lookup("decoder.layers.1.mlp.linear_fc2.weight")
    assert hf == ("model.layers.3.mlp.down_proj.weight",)
    with pytest.raises(KeyError, match="no Hugging Face mapping"):
        NameIndex(dims).lookup("decoder.layers.0.self_attention.q_layernorm.weight")


def test_smollm2_dims():
    dims = ModelDims.from_pretrained(smollm2_dir())
    assert (dims.family, dims.num_layers, dims.num_attention_heads, dims.num_kv_heads) == (
        "llama",
        30,
        9,
        3,
    )
    assert dims.tie_word_embeddings and not dims.qkv_bias and dims.rope_theta == 100000.0
    assert abs(dims.num_parameters - 134_515_008) < 1e3


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_lists_supported(tmp_path):
    model = _copy(tiny_qwen2_dir(), tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UnsupportedModelError,
        match=r"MistralForCausalLM.*LlamaForCausalLM', 'MixtralForCausalLM', 'Qwen2ForCausalLM",
    ):
        ModelDims.from_pretrained(model)


def test_missing_folder_config_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_hf_config(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        read_hf_config(tmp_path / "empty")
    model = _copy(tiny_qwen2_dir(), tmp_path)
    (model / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        SafetensorsReader(model)


def test_truncated_safetensors(tmp_path):
    model = _copy(tiny_qwen2_dir(), tmp_path)
    path = model / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated or corrupt"):
        reader = SafetensorsReader(model)
        for name in reader.names():
            reader.read(name)


def test_missing_shard_and_missing_tensor(tmp_path):
    model = _copy(tiny_qwen2_dir(), tmp_path)
    reader = SafetensorsReader(model)
    weight_map = {n: "model-00001-of-00002.safetensors" for n in reader.names()}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        CheckpointError, match=r"shard files \['model-00002-of-00002.safetensors'\].*missing"
    ):
        SafetensorsReader(model)
    del weight_map["lm_head.weight"]
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' is missing"):
        SafetensorsReader(model).read("lm_head.weight")
