"""``python -m bench.packing --smoke`` runs both modes (padded, packed) end to end in seconds and reports
what it measures; the speed figure itself is the benchmark's to print, not a test's to assert."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_packing_bench_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env["MEGARL_BENCH_RESULTS_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.packing", "--smoke"],  # bench/ is a package under ROOT
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    rows = dict(
        re.findall(
            r"^\s+round 1 (padded|packed)\s.*?(\d+) tokens through the model", proc.stdout, re.M
        )
    )
    assert set(rows) == {"padded", "packed"}, proc.stdout
    # the long-tailed lengths leave padding that packing removes
    assert int(rows["packed"]) < int(rows["padded"]), proc.stdout
    assert re.search(r"^RATIO packed/padded tokens/s = \d+\.\d+", proc.stdout, re.M), proc.stdout
    assert re.search(r"^MEMORY packed/padded peak = \d+\.\d+", proc.stdout, re.M), proc.stdout
    record = json.loads((tmp_path / "packing.smoke.json").read_text())
    assert record["figures"]["packed_over_padded_tokens_per_s"] > 0, record
