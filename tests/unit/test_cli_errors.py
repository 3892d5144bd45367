"""User errors reach the command line as one clear line and exit code 2, before any process starts."""

from __future__ import annotations

import json
import shutil

from megarl.cli import main
from tests.assets import smollm2_dir, tiny_qwen2_dir


def test_world_size_not_matching_layout(capsys):
    assert main(["demo", "--nproc", "3", "--tp", "2", "--pp", "1"]) == 2
    err = capsys.readouterr().err
    assert "world size 3 is not divisible by tp*pp = 2*1 = 2" in err


def test_tp_not_dividing_heads(capsys):
    assert (
        main(["demo", "--model", str(smollm2_dir()), "--nproc", "2", "--tp", "2", "--pp", "1"]) == 2
    )
    assert "Valid tp for this model: [1, 3]" in capsys.readouterr().err


def test_pp_larger_than_layers(capsys):
    assert (
        main(["demo", "--model", str(tiny_qwen2_dir()), "--nproc", "8", "--tp", "1", "--pp", "8"])
        == 2
    )
    assert "pp=8 is larger than the model's 4 layers" in capsys.readouterr().err


def test_unsupported_architecture_and_missing_model(tmp_path, capsys):
    model = tmp_path / "gpt2"
    shutil.copytree(tiny_qwen2_dir(), model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    assert main(["demo", "--model", str(model), "--nproc", "1", "--tp", "1", "--pp", "1"]) == 2
    assert "supports ['LlamaForCausalLM', 'Qwen2ForCausalLM']" in capsys.readouterr().err
    assert (
        main(
            ["demo", "--model", str(tmp_path / "missing"), "--nproc", "1", "--tp", "1", "--pp", "1"]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
