"""GSM-Symbolic problems for the benches, prepared offline by scripts/prepare_gsm8k.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prepare_gsm_symbolic(out: Path, train_size: int, test_size: int) -> None:
    """OUT/train.parquet and OUT/test.parquet (train and test from disjoint templates)."""
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "prepare_gsm8k.py"),
            "--out",
            str(out),
            "--source",
            "gsm-symbolic",
            "--train-size",
            str(train_size),
            "--test-size",
            str(test_size),
        ],
        check=True,
        capture_output=True,
    )
