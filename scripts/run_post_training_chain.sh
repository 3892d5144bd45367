#!/usr/bin/env bash
# The post-training chain on a CPU: SFT -> DPO -> GRPO (with distillation from the SFT model),
# each stage's final checkpoint exported to a Hugging Face folder that the next stage starts
# from. Usage: bash scripts/run_post_training_chain.sh [--nproc-per-node N]
# OUT (default outputs/chain) must match the paths in configs/chain_*_cpu.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/chain}
MEGARL=${MEGARL:-.venv/bin/megarl}
PY=${PYTHON:-.venv/bin/python}
NPROC=("$@")
[ ${#NPROC[@]} -eq 0 ] && NPROC=(--nproc-per-node 1)

export_latest() {  # RUN_DIR OUT_DIR: the run's latest checkpoint as a Hugging Face folder
  local step
  step=$(cat "$1/checkpoints/latest")
  rm -rf "$2"
  "$MEGARL" convert mcore-to-hf --ckpt "$1/checkpoints/$step/actor" --out "$2"
}

"$PY" -m megarl.quickstart --recipe chain --out "$OUT"
echo "[chain] 1/3 SFT" >&2
"$MEGARL" train-sft configs/chain_sft_cpu.yaml "${NPROC[@]}"
export_latest "$OUT/sft_run" "$OUT/sft_model"
echo "[chain] 2/3 DPO from the SFT model" >&2
"$MEGARL" train-dpo configs/chain_dpo_cpu.yaml "${NPROC[@]}"
export_latest "$OUT/dpo_run" "$OUT/dpo_model"
echo "[chain] 3/3 GRPO from the DPO model, distilling from the SFT model" >&2
"$MEGARL" train configs/chain_grpo_cpu.yaml "${NPROC[@]}"
export_latest "$OUT/grpo_run" "$OUT/grpo_model"
echo "[chain] done: $OUT/{sft,dpo,grpo}_model; metrics in $OUT/*_run/metrics.jsonl" >&2
