"""The conversion CLI as a user runs it: ``megarl convert hf-to-mcore`` under torchrun, export,
verify (passing, then failing on a tampered tensor), refusing an existing output, and a crash in
the middle of an export leaving nothing that looks like a finished folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.assets import tiny_llama_dir

ROOT = Path(__file__).resolve().parents[2]

_CRASH_AFTER_5_TENSORS = """
import os, sys
from checkpoints_tools.safetensors_writer import SafetensorsStreamWriter
from checkpoints_tools.cli import main
write, count = SafetensorsStreamWriter.write, [0]
def dying_write(self, name, tensor):
    write(self, name, tensor)
    count[0] += 1
    if count[0] == 5:
        os._exit(3)  # as if killed: no exception handler, no clean-up
SafetensorsStreamWriter.write = dying_write
sys.exit(main(sys.argv[1:]))
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def _tools(*args: str) -> subprocess.CompletedProcess:
    return _run("-m", "checkpoints_tools", *args)


def test_convert_export_verify_and_refuse(tmp_path):
    hf_src, ckpt, hf = tiny_llama_dir(), tmp_path / "ckpt", tmp_path / "hf"

    r = _run("-m", "megarl.cli", "convert", "hf-to-mcore", "--hf", str(hf_src), "--out", str(ckpt),
             "--tp", "1", "--pp", "2")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TP1xPP2" in r.stdout
    assert json.loads((ckpt / "megarl_checkpoint.json").read_text())["saved_layout"]["pp"] == 2

    r = _tools("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(hf), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "38 tensors" in r.stdout and "causal LM" in r.stdout

    r = _tools("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(hf))
    assert r.returncode == 2 and "pass --overwrite" in r.stderr

    r = _run("-c", _CRASH_AFTER_5_TENSORS, "mcore-to-hf", "--ckpt", str(ckpt),
             "--out", str(tmp_path / "crashed"), "--quiet")  # fmt: skip
    assert r.returncode == 3
    assert not (tmp_path / "crashed").exists()
    (partial,) = tmp_path.glob(".crashed.partial-*")
    assert not (partial / "config.json").exists()
    assert not (partial / "model.safetensors.index.json").exists()

    r = _tools("verify", "--hf", str(hf), "--ckpt", str(ckpt))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "38/38 bit-identical" in r.stdout and "VERIFY OK" in r.stdout
    assert "greedy-token agreement 1.000" in r.stdout

    (shard,) = hf.glob("model-*.safetensors")
    tensors = load_file(shard)
    tensors["model.layers.2.mlp.down_proj.weight"][3, 5] += 0.5
    save_file(tensors, shard, metadata={"format": "pt"})
    r = _tools("verify", "--hf", str(hf), "--ckpt", str(ckpt), "--no-logits")
    assert r.returncode == 1
    assert "37/38 bit-identical" in r.stdout and "VERIFY FAILED" in r.stdout
    assert "differs    model.layers.2.mlp.down_proj.weight max|diff| 5.000e-01" in r.stdout
