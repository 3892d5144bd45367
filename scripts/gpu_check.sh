#!/usr/bin/env bash
# megarl's GPU check in one command; prints a table and exits non-zero when a check fails.
#
#   bash scripts/gpu_check.sh [--wheels DIR] [--cpu] [--workdir DIR]
#
# --wheels DIR: offline packages the machine lacks (megatron-core, omegaconf, antlr4 ...), as
#               wheels or sdists; installed with pip --no-index into a temporary folder.
# --cpu:        the same checks at tiny sizes on the CPU (what CI runs).
# PYTHON:       the interpreter (default: the project's .venv/bin/python, which scripts/setup.sh
#               makes; python3 where there is none). The check itself is megarl/tools/gpu_check.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"
else
  PY=python3
fi
WHEELS=""
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [ -n "$WHEELS" ]; then
  DEPS="$(mktemp -d "${TMPDIR:-/tmp}/megarl-gpu-check-deps.XXXXXX")"
  trap 'rm -rf "$DEPS"' EXIT
  shopt -s nullglob
  PACKAGES=("$WHEELS"/*.whl "$WHEELS"/*.tar.gz)
  if [ ${#PACKAGES[@]} -eq 0 ]; then
    echo "gpu_check: no .whl or .tar.gz in $WHEELS" >&2
    exit 2
  fi
  "$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation \
    --target "$DEPS" "${PACKAGES[@]}"
  export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# cuBLAS picks deterministic kernels with this workspace setting (read when its handle is made,
# so before any matmul): the overlapped-reduce row compares runs bit for bit
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
cd "$ROOT"
"$PY" -m megarl.tools.gpu_check "${ARGS[@]}"
