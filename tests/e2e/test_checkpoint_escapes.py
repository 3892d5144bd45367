"""``megarl convert`` on a real checkpoint someone else tampered with: a symlinked tokenizer file
in ``hf/`` (which an export would copy into the folder that gets uploaded), a symlinked data
file, a ``latest`` pointing out of the run's folder, and a data shard crafted to run code (with a
manifest to match) are refused in one line naming what, and nothing is written or run. One
conversion in a subprocess; the exports run in this process (through the same load as resume)."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import megarl.checkpoint.manifest as manifest
from checkpoints_tools.cli import main as convert
from tests.assets import tiny_llama_dir

ROOT = Path(__file__).resolve().parents[2]
SECRET = "aws_secret_access_key=megarl-test-7f3a"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "ckpt"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl.cli",
            "convert",
            "hf-to-mcore",
            "--hf",
            str(tiny_llama_dir()),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001" / "actor"
    shutil.copytree(checkpoint, ckpt)
    return ckpt


def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "host" / "credentials"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def leaked(folder: Path) -> list[str]:
    if not folder.exists():
        return []
    files = [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]  # the plant
    return [p.name for p in files if SECRET.encode() in p.read_bytes()]


def test_export_refuses_a_symlinked_tokenizer_file(checkpoint, tmp_path, capsys):
    ckpt = copy_of(checkpoint, tmp_path)
    (ckpt / "hf" / "notes.tiktoken").symlink_to(secret_file(tmp_path))
    out = tmp_path / "export"
    code = convert(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert leaked(out) == [] and leaked(tmp_path / "run") == []
    assert code == 2 and "hf/notes.tiktoken" in err, err
    assert not out.exists()


def test_export_refuses_a_symlinked_data_file(checkpoint, tmp_path, capsys):
    ckpt = copy_of(checkpoint, tmp_path)
    data = sorted((ckpt / "mcore").glob("*.distcp"))[0]
    moved = tmp_path / "moved.distcp"
    shutil.move(data, moved)
    data.symlink_to(moved)
    out = tmp_path / "export"
    code = convert(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and f"mcore/{data.name}" in err, err
    assert not out.exists()


def test_convert_refuses_a_latest_that_leaves_the_run(checkpoint, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere" / "ckpt"
    shutil.copytree(checkpoint, elsewhere)
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "latest").write_text("../../elsewhere/ckpt\n")
    out = tmp_path / "export"
    code = convert(["mcore-to-hf", "--ckpt", str(root), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "latest" in err and "../../elsewhere/ckpt" in err, err
    assert not out.exists()


class Payload:
    """Unpickling this runs ``os.system``: it creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_shard_crafted_to_run_code_is_refused_in_one_line(checkpoint, tmp_path, capsys):
    """torch's distributed checkpoint reads shards inside its own collectives and wraps what a
    rank raised in an exception past ``except Exception`` whose text is tracebacks: the load
    says megarl's refusal in one line (exit 2) and the payload never runs."""
    ckpt = copy_of(checkpoint, tmp_path)
    shard = sorted((ckpt / "mcore").glob("*.distcp"))[0]
    marker = tmp_path / "payload-ran"
    payload = pickle.dumps(Payload(marker))
    shard.write_bytes(payload + bytes(shard.stat().st_size - len(payload)))
    records = manifest.read(ckpt)
    assert records is not None
    rel = str(shard.relative_to(ckpt))
    manifest.write(ckpt, [manifest.record(ckpt, rel) if r == rel else records[r] for r in records])
    out = tmp_path / "export"
    code = convert(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "holds more than plain data" in err and "refuses it" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not marker.exists() and not out.exists()
