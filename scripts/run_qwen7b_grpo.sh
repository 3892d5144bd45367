#!/usr/bin/env bash
# GRPO on GSM8K for Qwen2.5-7B-Instruct (configs/grpo_qwen2_5_7b.yaml), one node of 8 GPUs by
# default, several nodes through torchrun's rendezvous. Extra arguments are config overrides:
#
#   bash scripts/run_qwen7b_grpo.sh [section.key=value ...]
#
# Environment (all optional):
#   MODEL_PATH      local Hugging Face folder of the model. Unset: MODEL_ID is downloaded into
#                   MODEL_DIR with huggingface_hub when a hub is reachable.
#   MODEL_ID        hub id to download (default Qwen/Qwen2.5-7B-Instruct; Qwen/Qwen3-30B-A3B for
#                   CONFIG=configs/grpo_qwen3_30b_a3b.yaml)
#   MODEL_DIR       download target (default models/<name of MODEL_ID>)
#   DATA_DIR        GSM8K parquet folder; prepared with scripts/prepare_gsm8k.py when it holds no
#                   train.parquet (default data/gsm8k)
#   DATA_SOURCE     prepare_gsm8k.py --source: hub | PATH to a GSM8K copy | gsm-symbolic
#   CONFIG          the recipe (default configs/grpo_qwen2_5_7b.yaml; also ppo_qwen2_5_7b.yaml,
#                   grpo_qwen2_5_72b.yaml with MODEL_PATH or MODEL_ID to match, and the
#                   mixture-of-experts grpo_qwen3_30b_a3b.yaml)
#   OUTPUT_DIR      trainer.output_dir (default: the config's); several nodes: shared storage
#   MLFLOW_TRACKING_URI   trainer.mlflow_tracking_uri (default: the config's, ./mlflow.db)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE
#                   torchrun's rendezvous: run this script on every node with the same NNODES,
#                   MASTER_ADDR (node 0's address) and MASTER_PORT, and each node's NODE_RANK
#   PYTHON          interpreter (default: .venv/bin/python when present, else python3)
#
# Without MEGARL_SMOKE the script needs CUDA and says so on a machine without it; before any rank
# starts it runs the memory preflight for NNODES x GPUS_PER_NODE GPUs (`megarl train CONFIG
# --dry-run`, docs/preflight.md) and stops when a phase would not fit.
#
# MEGARL_SMOKE=1 runs the very same script at smoke size, on a CPU or on a GPU node: a tiny random
# model, GSM-Symbolic data generated offline, 2 steps, output in outputs/smoke (or OUTPUT_DIR).
# On a CPU: fp32, 4 local ranks at TP1 x PP2 x DP2 with vLLM at TP2. On a GPU node: the GPU
# defaults (bf16, Transformer Engine where installed), one rank per GPU up to 4. A config with
# expert parallelism (parallel.ep > 1) smoke-runs a tiny random Qwen3-MoE at EP2 instead, rolled
# out by the HF backend. The settings: megarl/tools/smoke.py.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
SMOKE="${MEGARL_SMOKE:-0}"
CONFIG="${CONFIG:-$ROOT/configs/grpo_qwen2_5_7b.yaml}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"

say() { echo "[run_qwen7b_grpo] $*" >&2; }
die() {
  echo "[run_qwen7b_grpo] error: $*" >&2
  exit 2
}
run() {
  say "+ $*"
  "$@"
}

if [[ "$SMOKE" == 1 ]]; then
  # local ranks, the config's parallel.ep, then the smoke overrides (CPU or GPU node)
  mapfile -t SMOKE_SETTINGS < <("$PYTHON" -m megarl.tools.smoke "$CONFIG")
  [[ "${#SMOKE_SETTINGS[@]}" -gt 2 ]] || die "cannot read $CONFIG"
  SMOKE_EP="${SMOKE_SETTINGS[1]}"
  OUTPUT_DIR="${OUTPUT_DIR:-$ROOT/outputs/smoke}"
  DATA_DIR="${DATA_DIR:-$OUTPUT_DIR/data}"
  DATA_SOURCE="${DATA_SOURCE:-gsm-symbolic}"
  GPUS_PER_NODE="${GPUS_PER_NODE:-${SMOKE_SETTINGS[0]}}"
  MLFLOW_TRACKING_URI="${MLFLOW_TRACKING_URI:-sqlite:///$OUTPUT_DIR/mlflow.db}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" # 4 ranks share the CPU cores
else
  DATA_DIR="${DATA_DIR:-$ROOT/data/gsm8k}"
  DATA_SOURCE="${DATA_SOURCE:-hub}"
  GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
fi

# --- the GPU recipe needs CUDA (the smoke mode is its CPU stand-in) ---------------------------
if [[ "$SMOKE" != 1 ]]; then
  "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null ||
    die "$(basename "$CONFIG") is a GPU recipe and $PYTHON sees no CUDA device (torch.cuda.is_available() is false, or torch is missing). Run it on a GPU node set up by scripts/setup.sh; MEGARL_SMOKE=1 runs this script on a CPU with a tiny model; 'megarl train $CONFIG --dry-run --gpus-per-node $GPUS_PER_NODE --nnodes $NNODES' checks the recipe's memory for those GPUs from any machine"
fi

# --- data: GSM8K as RL parquet (data_source "openai/gsm8k" selects the GSM8K rule scorer) ------
if [[ ! -f "$DATA_DIR/train.parquet" || ! -f "$DATA_DIR/test.parquet" ]]; then
  sizes=()
  if [[ "$SMOKE" == 1 ]]; then sizes=(--train-size 64 --test-size 16); fi
  run "$PYTHON" "$ROOT/scripts/prepare_gsm8k.py" --out "$DATA_DIR" --source "$DATA_SOURCE" \
    "${sizes[@]}" ||
    die "could not prepare GSM8K into DATA_DIR=$DATA_DIR from DATA_SOURCE=$DATA_SOURCE; set DATA_SOURCE to a local GSM8K folder or gsm-symbolic, or DATA_DIR to a folder with train.parquet and test.parquet"
fi

# --- model: a local Hugging Face folder, downloaded from the hub when none is given -----------
if [[ "$SMOKE" == 1 ]]; then
  # A tiny random Llama over a character vocabulary, built offline and cached (as the quickstart).
  if [[ "$SMOKE_EP" -gt 1 ]]; then
    MODEL_PATH="${MODEL_PATH:-$("$PYTHON" -c 'from megarl.tools.testing.assets import tiny_char_qwen3_moe_dir; print(tiny_char_qwen3_moe_dir())')}"
  else
    MODEL_PATH="${MODEL_PATH:-$("$PYTHON" -c 'from megarl.tools.testing.assets import tiny_char_llama_dir; print(tiny_char_llama_dir())')}"
  fi
elif [[ -z "${MODEL_PATH:-}" ]]; then
  case "$(basename "$CONFIG")" in
    grpo_qwen3_30b_a3b.yaml) MODEL_ID="${MODEL_ID:-Qwen/Qwen3-30B-A3B}" ;;
    *) MODEL_ID="${MODEL_ID:-Qwen/Qwen2.5-7B-Instruct}" ;;
  esac
  MODEL_PATH="${MODEL_DIR:-$ROOT/models/${MODEL_ID##*/}}"
  if [[ ! -f "$MODEL_PATH/.download-complete" ]]; then # an interrupted download resumes
    say "downloading $MODEL_ID into $MODEL_PATH (huggingface_hub.snapshot_download)"
    "$PYTHON" - "$MODEL_ID" "$MODEL_PATH" <<'PY' || die "set MODEL_PATH to a local Hugging Face folder of the model (config.json, *.safetensors, tokenizer files)"
import sys

repo, dest = sys.argv[1], sys.argv[2]
try:
    from huggingface_hub import snapshot_download

    snapshot_download(
        repo_id=repo,
        local_dir=dest,
        allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"],
    )
    open(f"{dest}/.download-complete", "w").close()
except Exception as e:  # no hub, no network, no access: say so in one line
    sys.exit(f"[run_qwen7b_grpo] cannot download {repo} from the Hugging Face hub: {type(e).__name__}: {e}")
PY
  fi
fi
[[ -f "$MODEL_PATH/config.json" ]] ||
  die "MODEL_PATH=$MODEL_PATH is not a Hugging Face model folder (no config.json); set MODEL_PATH to a local folder of the model"

# --- overrides: the recipe's paths, then smoke-size settings, then the caller's arguments ------
overrides=(
  "model.path=$MODEL_PATH"
  "data.train_files=[$DATA_DIR/train.parquet]"
  "data.val_files=[$DATA_DIR/test.parquet]"
)
if [[ -n "${OUTPUT_DIR:-}" ]]; then overrides+=("trainer.output_dir=$OUTPUT_DIR"); fi
if [[ -n "${MLFLOW_TRACKING_URI:-}" ]]; then
  overrides+=("trainer.mlflow_tracking_uri=$MLFLOW_TRACKING_URI")
fi
if [[ "$SMOKE" == 1 ]]; then
  # Same algorithm and recompute setting; smoke-sized model, batches, lengths and layout.
  overrides+=("${SMOKE_SETTINGS[@]:2}")
fi
overrides+=("$@")

# --- check the config, its batch split and its layout against the model before any rank starts -
# On GPUs: the launch's checks and the memory preflight of every phase for these nodes (exit 2
# naming what does not fit, and settings that would); in smoke mode the checks alone.
if [[ "$SMOKE" != 1 ]]; then
  "$PYTHON" -m megarl.cli train "$CONFIG" "${overrides[@]}" --dry-run \
    --gpus-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" || exit 2
else
"$PYTHON" - "$CONFIG" "$((NNODES * GPUS_PER_NODE))" "${overrides[@]}" <<'PY' || exit 2
import sys

from megarl.config import load_config, validate
from megarl.errors import MegarlError
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout

config, world, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
try:
    cfg = load_config(config, overrides)
    validate(cfg, world)
    p = cfg.parallel
    layout = ParallelLayout.for_world(
        world,
        tp=p.tp,
        pp=p.pp,
        pp_layers=p.pp_layers and tuple(p.pp_layers),
        infer_tp=p.infer_tp,
        ep=p.ep,
    )
    layout.check_model(ModelDims.from_pretrained(cfg.model.path).shape)
except MegarlError as e:
    sys.exit(f"megarl: error: {e}")
PY
fi

# --- launch: one torchrun per node; every rank runs megarl's training loop ---------------------
if [[ "$NNODES" -gt 1 ]]; then
  [[ -n "${MASTER_ADDR:-}" ]] || die "NNODES=$NNODES needs MASTER_ADDR (the address of node 0)"
  MASTER_PORT="${MASTER_PORT:-29500}"
else
  MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
  # A free port unless given: runs side by side on one machine must not collide.
  MASTER_PORT="${MASTER_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
fi
say "config $CONFIG, $NNODES node(s) x $GPUS_PER_NODE ranks, node rank $NODE_RANK"
run "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  --nproc-per-node "$GPUS_PER_NODE" \
  -m megarl.entry "$CONFIG" "${overrides[@]}"
