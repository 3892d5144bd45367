"""Prepare the CPU quickstart's model and data (offline), then print the command that runs it.

python -m megarl.quickstart [--out outputs/quickstart]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path


def prepare(out: Path) -> None:
    from megarl.testing.assets import tiny_char_llama_dir

    model = out / "model"
    if not model.is_dir():
        shutil.copytree(tiny_char_llama_dir(), model)
    data = out / "data"
    if not (data / "train.parquet").is_file():
        script = Path(__file__).resolve().parents[1] / "scripts" / "prepare_gsm8k.py"
        subprocess.run(
            [
                sys.executable,
                str(script),
                "--out",
                str(data),
                "--source",
                "gsm-symbolic",
                "--train-size",
                "512",
                "--test-size",
                "64",
            ],
            check=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="outputs/quickstart")
    args = parser.parse_args()
    prepare(Path(args.out))
    print(f"quickstart assets ready in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
