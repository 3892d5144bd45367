"""What a CUDA node needs for the pinned GPU stack, checked by ``scripts/setup.sh`` before any
download or build.

The stack itself is pinned in pyproject.toml (the ``gpu`` and ``te`` extras) to the versions the
CPU suite runs (``tests/unit/test_install_pins.py`` holds them equal). What pip cannot check is the
machine under it:

- torch 2.13.0's Linux wheel on PyPI is built for CUDA 13.0 (it requires
  ``cuda-toolkit==13.0.3`` and ``nvidia-nccl-cu13``): the NVIDIA driver must run CUDA 13, which
  the 580 driver branch is the first to do;
- Transformer Engine's PyTorch extension compiles against that torch with the machine's ``nvcc``,
  whose CUDA major release must be torch's (13).

Standard library only: setup.sh runs it with the system Python before the virtual environment
holds anything (``python3 megarl/gpu_stack.py [--no-te]``; exit 1 naming the fix).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

TORCH_CUDA = (13, 0)  # the CUDA release torch 2.13.0's PyPI wheel is built for
MIN_DRIVER = 580  # the first driver branch that runs CUDA 13.0 (CUDA 13.0 release notes)


@dataclass(frozen=True)
class Found:
    """What the machine has: the driver's version (None: no nvidia-smi answer) and nvcc's CUDA
    release (None: no nvcc found) with where it was looked for."""

    driver: str | None
    nvcc: tuple[int, int] | None
    nvcc_where: str


def parse_driver(text: str) -> str | None:
    """The first driver version in ``nvidia-smi --query-gpu=driver_version`` output."""
    for line in text.splitlines():
        if re.fullmatch(r"\d+(\.\d+)*", line.strip()):
            return line.strip()
    return None


def parse_nvcc(text: str) -> tuple[int, int] | None:
    """``(major, minor)`` of ``nvcc --version``'s ``release X.Y``."""
    m = re.search(r"release (\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def problems(found: Found, te: bool) -> list[str]:
    """What stops the pinned stack on this machine, each naming the fix (empty: nothing)."""
    out = []
    need = f"{TORCH_CUDA[0]}.{TORCH_CUDA[1]}"
    if found.driver is None:
        out.append(
            "nvidia-smi reports no driver version; install the NVIDIA driver "
            f"(>= {MIN_DRIVER}, for CUDA {need}) or run setup on a machine without a GPU"
        )
    elif int(found.driver.split(".")[0]) < MIN_DRIVER:
        out.append(
            f"NVIDIA driver {found.driver} cannot run CUDA {need}, which torch 2.13.0's wheel is "
            f"built for; upgrade the driver to the {MIN_DRIVER} branch or newer"
        )
    if not te:
        return out
    fix_te = "or run MEGARL_NO_TE=1 bash scripts/setup.sh (no Transformer Engine)"
    if found.nvcc is None:
        out.append(
            "Transformer Engine compiles its PyTorch extension with the CUDA toolkit, and no "
            f"nvcc is on PATH or in $CUDA_HOME ({found.nvcc_where}); install CUDA {need}'s "
            f"toolkit and cuDNN or set CUDA_HOME, {fix_te}"
        )
    elif found.nvcc[0] != TORCH_CUDA[0]:
        have = f"{found.nvcc[0]}.{found.nvcc[1]}"
        out.append(
            f"nvcc is CUDA {have} ({found.nvcc_where}) but torch 2.13.0 is built for CUDA {need}: "
            f"Transformer Engine's extension must be compiled by a CUDA {TORCH_CUDA[0]}.x nvcc; "
            f"install that toolkit and point CUDA_HOME at it, {fix_te}"
        )
    return out


def _run(argv: Sequence[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def on_this_machine() -> Found:
    driver = parse_driver(
        _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    )
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    nvcc = shutil.which("nvcc") or os.path.join(cuda_home, "bin", "nvcc")
    release = parse_nvcc(_run([nvcc, "--version"])) if os.access(nvcc, os.X_OK) else None
    return Found(driver, release, nvcc)


def main(argv: Sequence[str]) -> int:
    te = "--no-te" not in argv
    found = on_this_machine()
    errors = problems(found, te)
    for e in errors:
        print(f"[setup] error: {e}", file=sys.stderr)
    if not errors:
        nvcc = f", nvcc CUDA {found.nvcc[0]}.{found.nvcc[1]}" if te and found.nvcc else ""
        print(f"[setup] NVIDIA driver {found.driver}{nvcc}: the pinned CUDA stack can install")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
