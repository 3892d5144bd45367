"""User errors reach the command line as one clear line and exit code 2, before any process starts."""

from __future__ import annotations

import json
import shutil

import pytest

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
    supported = (
        "'LlamaForCausalLM', 'MixtralForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM', "
        "'Qwen3MoeForCausalLM'"
    )
    assert f"supports [{supported}]" in (capsys.readouterr().err)
    assert (
        main(
            ["demo", "--model", str(tmp_path / "missing"), "--nproc", "1", "--tp", "1", "--pp", "1"]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err


def test_srun_tasks_run_in_place_with_slurm_ranks(monkeypatch):
    from megarl.errors import ConfigError
    from megarl.launch import under_launcher

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        # set, then delete: monkeypatch then removes what under_launcher() sets, after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert not under_launcher()  # the batch script itself is no rank
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        under_launcher()
    monkeypatch.setenv("MASTER_ADDR", "node001")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert under_launcher()
    import os

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == (
        "5",
        "8",
        "1",
    )
