"""`scripts/gpu_check.sh --cpu`: the GPU check's code paths at tiny size on the CPU, so the script
cannot rot between the rare runs on a lent GPU. One process; the script itself fails (exit 1)
when a check does, and this test reads its table back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("section"))
    rows = []
    for line in lines[start + 2 :]:
        cells = [c.strip() for c in line.split(" | ")]
        if len(cells) < 3:
            break
        rows.append(cells)
    return rows


def test_gpu_check_cpu_mode_passes_every_check(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "gpu_check.sh"),
            "--cpu",
            "--workdir",
            str(tmp_path),
            "--json",
            str(tmp_path / "table.json"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "GPU CHECK OK" in proc.stdout
    rows = _rows(proc.stdout)
    sections = {r[0] for r in rows}
    assert sections == {
        "1 logits",
        "2 train step",
        "3 memory",
        "4 GRPO",
        "5 reshard",
        "6 fidelity",
        "7 versions",
    }
    by_check = {r[1]: r for r in rows}
    assert by_check["logits tiny-qwen2 fp32 (random tiny Qwen2)"][-1] == "ok"
    assert by_check["logits tiny-qwen2 bf16 (random tiny Qwen2)"][-1] == "ok"
    assert by_check["steps run (3, then resumed to 5; HF rollout)"][2] == "[1, 2, 3, 4, 5]"
    checks = [r for r in rows if r[-1] in ("ok", "FAIL")]
    assert len(checks) >= 6 and all(r[-1] == "ok" for r in checks)
    tokens = [r for r in rows if r[1].startswith("megarl tokens/s")]
    assert tokens and float(tokens[0][2].replace(",", "")) > 0
    assert (tmp_path / "grpo" / "hf" / "config.json").is_file()  # the verified export
    assert by_check["rollout weights == checkpoint"][-1] == "ok"
    assert by_check["refilled by the next reshard == checkpoint"][-1] == "ok"
    assert (
        by_check["bf16 error vs transformers fp32, tiny-qwen2: megarl / transformers"][-1] == "ok"
    )
    for which in ("first", "second"):
        trip = by_check[f"param offload round trip, {which} (weights, grads, Adam states)"]
        assert trip[-1] == "ok"
    for who in ("megarl", "transformers"):  # "12.3 ms: 10.1 / 2.0 ms"
        phases = by_check[f"{who} step: forward+backward / optimizer"][2]
        assert all(float(x) > 0 for x in phases.replace("ms", "").replace(":", " /").split("/"))
    # the rollout's grad-buffer release (the fidelity rows that run without CUDA)
    released = "grad buffers released before the rollout (bytes freed / buffer bytes)"
    assert by_check[released][-1] == "ok"
    assert by_check["grad buffers restored zeroed, next step finite"][-1] == "ok"
    # --json holds the same rows as the printed table
    stored = json.loads((tmp_path / "table.json").read_text())
    assert stored["ok"] is True
    assert [[r["section"], r["check"], r["value"]] for r in stored["rows"]] == [r[:3] for r in rows]


def test_gpu_check_uses_the_projects_interpreter():
    """Without PYTHON the script runs .venv's interpreter (the system python3 lacks torch)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--cpu" in proc.stdout  # megarl.tools.gpu_check's own usage, printed by .venv's python
