"""A checkpoint or run folder from someone else never makes megarl read or write outside it:
symlinked or absolute paths in its Hugging Face assets, its dist-checkpoint metadata, its
manifests and its ``latest`` pointer are refused naming the entry, and a run folder's temporary
files are created afresh, never through a link planted under their name."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import megarl.checkpoint.manifest as manifest
from megarl.checkpoint.hf_assets import copy_hf_assets
from megarl.checkpoint.reader import DistCheckpointReader
from megarl.checkpoint.safe_metadata import read_dist_metadata
from megarl.checkpoint.store import META_FILE, resolve_checkpoint
from megarl.errors import CheckpointError
from megarl.run import verification

pytestmark = pytest.mark.unit

KEY = "embedding.word_embeddings.weight"


def tiny_dist_checkpoint(path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({KEY: torch.arange(8.0).reshape(4, 2)}, checkpoint_id=str(path), no_dist=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    return path


def test_a_symlinked_hf_asset_is_refused_not_copied(tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("password=hunter2")
    hf = tmp_path / "ckpt" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (hf / "notes.tiktoken").symlink_to(secret)
    out = tmp_path / "export"
    with pytest.raises(CheckpointError, match=r"notes\.tiktoken"):
        copy_hf_assets(hf, out)
    leaked = [p for p in out.rglob("*") if p.is_file() and "hunter2" in p.read_text()]
    assert leaked == []


def test_a_symlinked_data_file_is_refused_naming_it(tmp_path):
    mcore = tiny_dist_checkpoint(tmp_path / "ckpt" / "mcore")
    data = next(mcore.glob("*.distcp"))
    elsewhere = tmp_path / "elsewhere.bin"
    os.replace(data, elsewhere)
    data.symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=data.name), DistCheckpointReader(mcore) as reader:
        reader.read(KEY)


def test_an_absolute_storage_path_in_the_metadata_is_refused_naming_it(tmp_path):
    mcore = tiny_dist_checkpoint(tmp_path / "ckpt" / "mcore")
    data = next(mcore.glob("*.distcp"))
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(data.read_bytes())  # what the checkpoint would read instead
    md = read_dist_metadata(mcore)
    for info in md.storage_data.values():
        info.relative_path = str(outside)
    (mcore / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"outside\.distcp"):
        DistCheckpointReader(mcore)
    # the same refusal where megatron's own load reads the metadata (one reader for both)
    for info in md.storage_data.values():
        info.relative_path = "../outside.distcp"
    (mcore / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"\.\./outside\.distcp"):
        read_dist_metadata(mcore)


def test_manifest_entries_leaving_the_folder_are_refused_not_probed(tmp_path):
    """``../`` entries would tell whether a host file exists, its size and its checksum."""
    probe = tmp_path / "host-file.bin"
    probe.write_bytes(b"x" * 1234)
    ckpt = tmp_path / "run" / "ckpt"
    (ckpt / "mcore").mkdir(parents=True)
    (ckpt / META_FILE).write_text("{}")
    body = {
        "format": manifest.FORMAT,
        "hash": manifest.HASH,
        "files": {
            "../../host-file.bin": {"bytes": 1234, manifest.HASH: manifest.checksum(probe)},
        },
    }
    (ckpt / manifest.MANIFEST_FILE).write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match=r"\.\./\.\./host-file\.bin"):
        manifest.verify(ckpt)
    body["files"] = {str(probe): {"bytes": 1234, manifest.HASH: manifest.checksum(probe)}}
    (ckpt / manifest.MANIFEST_FILE).write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match=r"host-file\.bin"):
        manifest.verify(ckpt)


def test_a_manifest_entry_through_a_symlink_counts_as_damage(tmp_path):
    root = tmp_path / "checkpoints"
    step = root / "step_00000002"
    actor = step / "actor"
    (actor / "mcore").mkdir(parents=True)
    (actor / META_FILE).write_text('{"role": "actor"}')
    (actor / "mcore" / "__0_0.distcp").write_bytes(b"y" * 100)
    manifest.write(actor, [manifest.record(actor, n) for n in manifest.files_under(actor)])
    (step / "trainer").mkdir()
    (step / "trainer" / "trainer_state.pt").write_bytes(b"state")
    manifest.write(step, [manifest.record(step, "trainer/trainer_state.pt")])
    elsewhere = tmp_path / "elsewhere.distcp"
    os.replace(actor / "mcore" / "__0_0.distcp", elsewhere)
    (actor / "mcore" / "__0_0.distcp").symlink_to(elsewhere)
    problems = verification.verify_step(step)
    assert any("mcore/__0_0.distcp" in p and "link" in p for p in problems), problems


def test_latest_pointing_outside_the_root_is_refused_naming_it(tmp_path):
    outside = tmp_path / "someone-elses"
    outside.mkdir()
    (outside / META_FILE).write_text("{}")
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "latest").write_text("../../someone-elses\n")
    with pytest.raises(CheckpointError, match=r"latest.*\.\./\.\./someone-elses"):
        resolve_checkpoint(root)
    (root / "latest").write_text(str(outside) + "\n")
    with pytest.raises(CheckpointError, match="latest"):
        resolve_checkpoint(root)
    (root / "latest").unlink()
    (root / "latest").symlink_to(outside / META_FILE)
    with pytest.raises(CheckpointError, match="latest"):
        resolve_checkpoint(root)


def test_a_symlinked_checkpoint_folder_inside_a_run_is_refused(tmp_path):
    outside = tmp_path / "someone-elses"
    outside.mkdir()
    (outside / META_FILE).write_text("{}")
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "step_00000002").symlink_to(outside, target_is_directory=True)
    (root / "latest").write_text("step_00000002\n")
    with pytest.raises(CheckpointError, match="step_00000002"):
        resolve_checkpoint(root)


# -- run folders ----------------------------------------------------------------------------


def planted(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A run folder with a symlink named ``name`` pointing at a file outside it."""
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    victim = tmp_path / f"victim-{name.strip('.')}"
    victim.write_text("precious")
    (run / name).symlink_to(victim)
    return run, victim


def test_the_report_never_writes_through_a_planted_partial_file(tmp_path):
    from megarl.report import write_report

    run, victim = planted(tmp_path, "report.html.partial")
    (run / "metrics.jsonl").write_text('{"step": 1, "actor/loss": 0.5}\n')
    out = write_report(run)
    assert victim.read_text() == "precious"
    assert out.is_file() and not out.is_symlink() and "<html" in out.read_text()


def test_metrics_are_never_rewritten_through_a_planted_temporary_file(tmp_path):
    from megarl.run.output_dir import restart_metrics
    from megarl.run.tracking import cut_metrics

    run, victim = planted(tmp_path, ".metrics.jsonl.tmp")
    metrics = run / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    assert cut_metrics(metrics, 2) == 1
    assert victim.read_text() == "precious"
    assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n'
    restart_metrics(metrics)
    assert victim.read_text() == "precious" and metrics.read_text() == ""
