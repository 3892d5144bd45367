"""The trainer-state file: plain data only, read with weights_only=True; a crafted file that
carries a pickle payload is refused with a clear error and the payload does not run."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megarl.checkpoint.store import META_FILE, CheckpointMeta
from megarl.errors import CheckpointError
from megarl.run import checkpointing, trainer_state
from tests.assets import tiny_char_llama_dir

pytestmark = pytest.mark.unit


def plain_state() -> dict:
    return {
        "step": 3,
        "rollouts": 3,
        "kl_ctrl": {"kind": "adaptive", "value": 0.01},
        "history": [{"reward/mean": 0.5}],
        "mlflow_run_id": None,
        "rng": {"layout": [1, 1, 1], "ranks": {"tp0.pp0.dp0": {"torch": torch.get_rng_state()}}},
        "schedulers": {"actor": {"max_lr": 1e-3, "lr_decay_style": "constant", "num_steps": 3}},
        "adam_steps": {"actor": [3.0, None]},
    }


def checkpoint_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "step_00000003"
    (folder / "trainer").mkdir(parents=True)
    return folder


def test_plain_state_round_trips(tmp_path):
    folder = checkpoint_folder(tmp_path)
    state = plain_state()
    trainer_state.write(folder / "trainer", state)
    back = trainer_state.read(folder)
    assert back["step"] == 3 and back["history"] == state["history"]
    assert torch.equal(back["rng"]["ranks"]["tp0.pp0.dp0"]["torch"], torch.get_rng_state())


def test_objects_are_not_written(tmp_path):
    folder = checkpoint_folder(tmp_path)
    with pytest.raises(TypeError, match=r"trainer state\['when'\] is a PosixPath"):
        trainer_state.write(folder / "trainer", {"when": Path("/")})


class Payload:
    """Unpickling this would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("writer", ["torch.save", "raw pickle"])
def test_a_pickle_payload_is_refused_and_does_not_run(tmp_path, writer):
    folder = checkpoint_folder(tmp_path)
    marker = tmp_path / "payload-ran"
    crafted = {"format": trainer_state.FORMAT, **plain_state(), "step": Payload(marker)}
    path = folder / "trainer" / trainer_state.FILE
    if writer == "torch.save":
        torch.save(crafted, path)
    else:
        path.write_bytes(pickle.dumps(crafted))
    with pytest.raises(CheckpointError) as err:
        trainer_state.read(folder)
    message = str(err.value)
    assert str(path) in message and "could run code" in message and "refuses" in message
    assert not marker.exists()


def test_damaged_file_names_the_folder(tmp_path):
    folder = checkpoint_folder(tmp_path)
    (folder / "trainer" / trainer_state.FILE).write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match="damaged"):
        trainer_state.read(folder)


def fake_training_checkpoint(tmp_path: Path, roles: list[str], hidden_size: int | None) -> Path:
    """A checkpoint folder with the trainer state and each role's description and HF config."""
    folder = checkpoint_folder(tmp_path)
    trainer_state.write(folder / "trainer", {**plain_state(), "roles": roles})
    config = json.loads((tiny_char_llama_dir() / "config.json").read_text())
    if hidden_size is not None:
        config["hidden_size"] = hidden_size
    for role in roles:
        (folder / role / "hf").mkdir(parents=True)
        (folder / role / "hf" / "config.json").write_text(json.dumps(config))
        meta = CheckpointMeta(
            role=role, architecture="LlamaForCausalLM", dtype="float32", saved_layout={}
        )
        (folder / role / META_FILE).write_text(meta.to_json())
        write_tiny_dist_checkpoint(folder / role / "mcore")
    return folder


def write_tiny_dist_checkpoint(path: Path) -> None:
    """A one-tensor torch dist checkpoint (what resume reads the metadata of, the safe way)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"embedding.word_embeddings.weight": torch.zeros(2, 2)},
        checkpoint_id=str(path),
        no_dist=True,
    )


def test_resume_checks_roles_and_model_before_any_heavy_work(tmp_path):
    model = str(tiny_char_llama_dir())
    ok = fake_training_checkpoint(tmp_path / "ok", ["actor"], None)
    assert checkpointing.check_resume(ok, ["actor"], {"actor": model})["step"] == 3
    with pytest.raises(
        CheckpointError, match=r"trains \['actor'\], this run trains \['actor', 'critic'\]"
    ):
        checkpointing.check_resume(ok, ["actor", "critic"], {"actor": model, "critic": model})
    ppo = fake_training_checkpoint(tmp_path / "ppo", ["actor", "critic"], None)
    with pytest.raises(CheckpointError, match="another algorithm"):
        checkpointing.check_resume(ppo, ["actor"], {"actor": model})
    other = fake_training_checkpoint(tmp_path / "other", ["actor"], 999)
    with pytest.raises(CheckpointError, match=r"another actor model.*hidden 999"):
        checkpointing.check_resume(other, ["actor"], {"actor": model})
    shutil.rmtree(tmp_path)
