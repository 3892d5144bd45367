"""checkpoints_tools and megarl.checkpoint without processes: name maps, the export plan, the
streaming safetensors writer, the dist-checkpoint reader, atomic output folders, and every user
error of the CLI (exit code 2, a message naming the fix)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from checkpoints_tools.cli import main as tools_main
from checkpoints_tools.mcore_to_hf import Group, plan_shards
from checkpoints_tools.safetensors_writer import SafetensorsStreamWriter
from megarl.checkpoint.hf_assets import export_config, hf_role
from megarl.checkpoint.keys import LOCAL_SPEC_KEYS_MAP, dist_checkpoint_key
from megarl.checkpoint.reader import DistCheckpointReader
from megarl.checkpoint.store import (
    LATEST_FILE,
    META_FILE,
    CheckpointMeta,
    resolve_checkpoint,
    staged_output,
    write_latest,
)
from megarl.cli import main as megarl_main
from megarl.errors import CheckpointError, UnsupportedModelError
from megarl.models.dims import ModelDims
from megarl.models.hf_map import NameIndex, tensor_maps
from tests.assets import tiny_llama_dir, tiny_qwen2_dir

# -- name maps ----------------------------------------------------------------------------------


def test_critic_maps_name_the_value_head_score_and_keep_the_trunk():
    dims = ModelDims.from_pretrained(tiny_llama_dir())  # tied embeddings
    actor = {tm.megatron: tm for tm in tensor_maps(dims)}
    critic = {tm.megatron: tm for tm in tensor_maps(dims, "critic")}
    assert actor["output_layer.weight"].hf == ("model.embed_tokens.weight",)
    assert "output_layer.bias" not in actor
    assert critic["output_layer.weight"].hf == ("score.weight",)
    assert critic["output_layer.bias"].hf == ("score.bias",)
    assert critic["output_layer.weight"].tp_dim is None  # replicated over TP
    trunk = {k for k in actor if not k.startswith("output_layer")}
    assert trunk == {k for k in critic if not k.startswith("output_layer")}
    _, names = NameIndex(dims, role="critic").lookup("output_layer.bias")
    assert names == ("score.bias",)
    _, names = NameIndex(dims, layer_offset=2).lookup("decoder.layers.1.mlp.linear_fc1.weight")
    assert names == ("model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight")


def test_dist_checkpoint_keys_follow_megatrons_te_compatible_names():
    """Pinned against megatron's real sharded_state_dict in tests/distributed (importing the
    layer specs here would load megatron modules the platform pin test does not expect)."""
    assert set(LOCAL_SPEC_KEYS_MAP) == {"input_layernorm.", "pre_mlp_layernorm."}
    assert (
        dist_checkpoint_key("decoder.layers.{layer}.input_layernorm.weight")
        == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    )
    assert (
        dist_checkpoint_key("decoder.layers.{layer}.pre_mlp_layernorm.weight")
        == "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    )
    assert (
        dist_checkpoint_key("decoder.layers.{layer}.self_attention.linear_qkv.bias")
        == "decoder.layers.self_attention.linear_qkv.bias"
    )
    assert dist_checkpoint_key("embedding.word_embeddings.weight") == (
        "embedding.word_embeddings.weight"
    )


def test_export_config_of_actor_and_critic():
    cfg = json.loads((tiny_qwen2_dir() / "config.json").read_text())
    actor = export_config(cfg, "actor", "bfloat16")
    assert actor["architectures"] == ["Qwen2ForCausalLM"] and actor["dtype"] == "bfloat16"
    critic = export_config(cfg, "critic", "float32")
    assert critic["architectures"] == ["Qwen2ForTokenClassification"]
    assert critic["id2label"] == {"0": "LABEL_0"}
    assert hf_role(critic) == "critic" and hf_role(actor) == "actor"
    # and back: a critic's config exports as the same critic
    assert export_config(critic, "critic", "float32") == critic
    with pytest.raises(UnsupportedModelError, match="num_labels=1"):
        hf_role({**critic, "id2label": {"0": "A", "1": "B"}})


# -- streaming safetensors writer -----------------------------------------------------------------


def test_stream_writer_output_reads_back_exactly(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(7, 5, generator=gen),
        "b.bias": torch.randn(3, generator=gen).to(torch.bfloat16),
        "c.scalar": torch.tensor(2.5),
        "d.empty": torch.zeros(0, 4),
    }
    path = tmp_path / "x.safetensors"
    with SafetensorsStreamWriter(
        path, [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    ) as w:
        for k, v in tensors.items():
            w.write(k, v)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(tensors)
        for k, v in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and torch.equal(got, v), k
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_stream_writer_takes_a_tensor_as_blocks_of_rows(tmp_path):
    full = torch.arange(40.0).reshape(10, 4)
    path = tmp_path / "x.safetensors"
    entries = [("emb", (10, 4), torch.float32), ("norm", (4,), torch.float32)]
    with SafetensorsStreamWriter(path, entries) as w:
        w.write("emb", full[:3])
        with pytest.raises(ValueError, match="rows 3 written"):
            w.write("emb", full[:8])  # 3 + 8 rows > 10
        with pytest.raises(ValueError, match="rows 3 written"):
            w.write("emb", full)  # a whole tensor after a block
        w.write("emb", full[3:])
        w.write("norm", torch.ones(4))
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("emb"), full)
        assert torch.equal(f.get_tensor("norm"), torch.ones(4))


def test_stream_writer_refuses_unplanned_or_missing_tensors(tmp_path):
    entries = [("a", (2,), torch.float32), ("b", (2,), torch.float32)]
    w = SafetensorsStreamWriter(tmp_path / "x.safetensors", entries)
    with pytest.raises(ValueError, match="expected a"):
        w.write("b", torch.zeros(2))
    with pytest.raises(ValueError, match="expected a"):
        w.write("a", torch.zeros(3))
    w.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="never written"):
        w.close()


def test_shards_never_split_a_group_and_respect_the_size():
    tm = tensor_maps(ModelDims.from_pretrained(tiny_qwen2_dir()))[0]

    def group(i, rows):
        return Group(tm, f"k{i}", None, ((f"t{i}", (rows, 4)),), (rows, 4))

    groups = [group(0, 10), group(1, 10), group(2, 100), group(3, 1), group(4, 1)]
    shards = plan_shards(groups, torch.float32, max_bytes=400)  # 10 rows = 160 bytes
    assert [[g.key for g in s] for s in shards] == [["k0", "k1"], ["k2"], ["k3", "k4"]]


# -- dist checkpoint reader -----------------------------------------------------------------------


def _tiny_dist_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    state = {
        "decoder.layers.mlp.linear_fc2.weight": torch.arange(24.0).reshape(3, 2, 4),
        "embedding.word_embeddings.weight": torch.randn(5, 4),
    }
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    return state


def test_reader_reads_whole_tensors_and_single_layers(tmp_path):
    state = _tiny_dist_checkpoint(tmp_path / "mcore")
    with DistCheckpointReader(tmp_path / "mcore") as r:
        emb = "embedding.word_embeddings.weight"
        assert torch.equal(r.read(emb), state[emb])
        key, index = r.layer_key("decoder.layers.mlp.linear_fc2.weight", 2)
        assert index == 2 and r.shape(key) == (3, 2, 4)
        assert torch.equal(r.read(key, index), state[key][2])
        assert torch.equal(torch.cat(list(r.row_blocks(emb))), state[emb])
        with pytest.raises(CheckpointError, match="layer 3 is missing"):
            r.read(key, 3)
        with pytest.raises(CheckpointError, match="does not hold this model"):
            r.layer_key("decoder.layers.mlp.linear_fc1.weight", 0)


def test_reader_names_missing_and_truncated_data_files(tmp_path):
    _tiny_dist_checkpoint(tmp_path / "mcore")
    data = next((tmp_path / "mcore").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{data.name} is truncated"):
        DistCheckpointReader(tmp_path / "mcore")
    data.unlink()
    with pytest.raises(CheckpointError, match=f"{data.name} is missing"):
        DistCheckpointReader(tmp_path / "mcore")
    (tmp_path / "mcore" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="not a complete megatron dist checkpoint"):
        DistCheckpointReader(tmp_path / "mcore")


# -- folders: resolution, atomic output ---------------------------------------------------------


def _fake_checkpoint(path: Path) -> Path:
    (path / "mcore").mkdir(parents=True)
    meta = CheckpointMeta("actor", "Qwen2ForCausalLM", "float32", {"tp": 1, "pp": 1, "dp": 1})
    (path / META_FILE).write_text(meta.to_json())
    return path


def test_resolve_follows_latest_and_explains_partial_folders(tmp_path):
    root = tmp_path / "run"
    _fake_checkpoint(root / "step_00000001")
    _fake_checkpoint(root / "step_00000002")
    write_latest(root, "step_00000002")
    assert resolve_checkpoint(root) == root / "step_00000002"
    assert resolve_checkpoint(root / "step_00000001") == root / "step_00000001"
    (root / LATEST_FILE).write_text("step_00000009\n")
    with pytest.raises(CheckpointError, match=r"step_00000009.*complete checkpoints"):
        resolve_checkpoint(root)
    (root / "step_00000002" / META_FILE).unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        resolve_checkpoint(root / "step_00000002")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a megarl checkpoint"):
        resolve_checkpoint(tmp_path / "empty")


def test_staged_output_is_all_or_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), staged_output(out) as tmp:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("boom")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # the temporary folder is gone too
    with staged_output(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert (out / "config.json").is_file()
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)  # not left private by mkdtemp
    with pytest.raises(CheckpointError, match="--overwrite"), staged_output(out):
        pass
    with staged_output(out, overwrite=True) as tmp:
        (tmp / "config.json").write_text('{"new": 1}')
    assert json.loads((out / "config.json").read_text()) == {"new": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with (
        pytest.raises(CheckpointError, match="refusing to overwrite"),
        staged_output(precious, overwrite=True),
    ):
        pass
    assert (precious / "notes.txt").read_text() == "keep me"


# -- CLI user errors: exit code 2 and the fix in the message ------------------------------------


def _run(capsys, argv, via_megarl=False):
    code = megarl_main(["convert", *argv]) if via_megarl else tools_main(argv)
    return code, capsys.readouterr().err


def test_cli_refuses_a_tp_the_model_cannot_take(capsys):
    code, err = _run(
        capsys, ["hf-to-mcore", "--hf", str(tiny_qwen2_dir()), "--out", "/tmp/x", "--tp", "4"]
    )
    assert code == 2
    assert "tp=4 does not divide" in err and "Valid tp for this model: [1, 2]" in err


def test_cli_refuses_missing_inputs_and_existing_outputs(capsys, tmp_path):
    code, err = _run(
        capsys, ["hf-to-mcore", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]
    )
    assert code == 2 and "does not exist" in err
    (tmp_path / "exists").mkdir()
    code, err = _run(
        capsys,
        ["hf-to-mcore", "--hf", str(tiny_qwen2_dir()), "--out", str(tmp_path / "exists")],
        via_megarl=True,
    )
    assert code == 2 and "pass --overwrite" in err
    code, err = _run(
        capsys, ["mcore-to-hf", "--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]
    )
    assert code == 2 and "does not exist" in err
    code, err = _run(capsys, ["verify", "--hf", str(tmp_path / "nope"), "--ckpt", str(tmp_path)])
    assert code == 2 and "does not exist" in err
    hf = tiny_qwen2_dir()
    code, err = _run(
        capsys, ["hf-to-mcore", "--hf", str(hf), "--out", str(hf / "ckpt"), "--overwrite"]
    )
    assert code == 2 and "overlaps the Hugging Face folder" in err
    ckpt = _fake_checkpoint(tmp_path / "ckpt")
    code, err = _run(
        capsys, ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(ckpt), "--overwrite"]
    )
    assert code == 2 and "overlaps the checkpoint" in err


def test_cli_refuses_partial_inputs(capsys, tmp_path):
    partial = tmp_path / "partial_ckpt"
    (partial / "mcore").mkdir(parents=True)
    code, err = _run(capsys, ["mcore-to-hf", "--ckpt", str(partial), "--out", str(tmp_path / "o")])
    assert code == 2 and "incomplete checkpoint" in err
    hf = tmp_path / "partial_hf"
    hf.mkdir()
    (hf / "config.json").write_text((tiny_qwen2_dir() / "config.json").read_text())
    code, err = _run(capsys, ["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o")])
    assert code == 2 and "no safetensors weights" in err
    # weights of a smaller model under this config: tensors are missing
    cfg = json.loads((tiny_qwen2_dir() / "config.json").read_text())
    cfg["num_hidden_layers"] = 6
    (hf / "config.json").write_text(json.dumps(cfg))
    os.symlink(tiny_qwen2_dir() / "model.safetensors", hf / "model.safetensors")
    code, err = _run(capsys, ["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o")])
    assert code == 2 and "lacks 24 tensors" in err and "model.layers.4." in err
