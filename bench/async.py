"""Colocated vs asynchronous training on this CPU, with the pipeline model's prediction beside
each measured figure.

    .venv/bin/python -m bench.async                   # 2 processes, 12 steps per run
    .venv/bin/python -m bench.async --procs 4 --steps 16 --staleness 0,1,2
    .venv/bin/python -m bench.async --smoke           # seconds: 2 steps per run

The task is the quickstart's (configs/quickstart_cpu.yaml: a tiny random character-level Llama
learning the vowel reward on GSM-Symbolic prompts; 8 prompts x 4 samples x 32 tokens per step),
run as `megarl train` with the same total processes each way, one thread per process:

- colocated: every process generates, then trains (DP = procs);
- async, per staleness bound: the last procs / 2 processes are the rollout group, the others
  train (DP = procs / 2), rollout.placement.max_staleness = 0, 1, ...

From the colocated run the bench takes its phase times (megarl.plan.pipeline.PhaseTimes: the
medians of its steps after the first) and predicts each async run's step time and staleness with
the pipeline model (megarl.plan.pipeline.predict_async; the weight broadcast costing what the
colocated reshard did) twice: with the work of a phase split evenly over its devices ("pred"),
and with each phase's scaling fitted from a second colocated run on half the processes ("fit",
MeasuredScaling.fitted), then prints measured and predicted side by side, with the ratio of each run's throughput to the colocated run's. Step
times are the medians after the first --warmup steps (start-up and the first weight transfer
excluded). Writes bench/results/async.json. Nothing is asserted.

On 2 cores the processes share the cores: what async can gain here is the switch between
rollout and training and the idle time of unequal phases, not extra hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gsm_data import prepare_gsm_symbolic
from bench.results_io import matmul_peaks, write_results
from megarl.plan.pipeline import MeasuredScaling, PhaseTimes, predict_async

ROOT = Path(__file__).resolve().parents[1]

CONFIG = ROOT / "configs" / "quickstart_cpu.yaml"


def prepare(work: Path) -> tuple[Path, Path]:
    """The quickstart's model and data (offline, cached under ``work``)."""
    from megarl.tools.testing.assets import tiny_char_llama_dir

    data = work / "data"
    if not (data / "train.parquet").is_file():
        prepare_gsm_symbolic(data, 512, 16)
    return tiny_char_llama_dir(), data / "train.parquet"


def config(work: Path, model: Path, train: Path, steps: int) -> Path:
    import yaml

    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["model"]["path"] = str(model)
    cfg["data"].update(train_files=[str(train)], val_files=[])
    cfg["trainer"].update(
        total_steps=steps,
        test_freq=0,
        save_freq=0,
        resume="never",
        loggers=["console"],
        mlflow_tracking_uri="none",
        experiment="bench-async",
    )
    path = work / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(cfg: Path, out: Path, procs: int, *overrides: str) -> list[dict]:
    """One `megarl train`; its metrics records."""
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MASTER_PORT", None)
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(cfg), f"trainer.output_dir={out}"]
    cmd += [*overrides, "--nproc-per-node", str(procs)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"megarl train failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    what = " ".join(overrides) or "colocated"
    print(f"  {what}, {procs} processes: {time.perf_counter() - t0:.0f} s", flush=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steady(records: list[dict], key: str, warmup: int) -> float:
    values = [r[key] for r in records if key in r][warmup:]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=2, help="processes of every run (even)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument(
        "--staleness",
        default="0,1",
        help="rollout.placement.max_staleness values of the async runs",
    )
    p.add_argument(
        "--work", default=None, help="folder for data and runs (default: a temporary one)"
    )
    p.add_argument("--smoke", action="store_true", help="2 steps per run, staleness 1 only")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.staleness = 2, 1, "1"
    if args.procs < 2 or args.procs % 2:
        raise SystemExit("--procs must be even and >= 2 (half of them roll out)")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="megarl-bench-async-"))
    work.mkdir(parents=True, exist_ok=True)
    model, train = prepare(work)
    cfg = config(work, model, train, args.steps)
    peak_size = 256 if args.smoke else 2048
    peaks = matmul_peaks(peak_size)
    print(
        f"machine: fp32 matmul peak {peaks['fp32_gflops']:.0f} GFLOP/s ({peaks['threads']} threads)"
    )

    colocated = run(cfg, work / "colocated", args.procs)
    phases = PhaseTimes.from_metrics(colocated, devices=args.procs, skip=args.warmup)
    scaling = MeasuredScaling(phases)
    half = args.procs // 2
    # The same task colocated on half the processes (the size of each async group): how each
    # phase really scales with its devices, fitted into the model's exponents.
    narrow_records = run(cfg, work / "colocated_narrow", half)
    narrow = PhaseTimes.from_metrics(narrow_records, devices=half, skip=args.warmup)
    fitted = MeasuredScaling.fitted(phases, narrow)
    co_step = steady(colocated, "timing/step_s", args.warmup)
    co_tps = steady(colocated, "perf/tokens_per_s", args.warmup)
    rows = [
        {
            "mode": "colocated",
            "rollout_ranks": 0,
            "trainers": args.procs,
            "max_staleness": None,
            "step_s": co_step,
            "predicted_step_s": phases.generate_s + phases.switch_s + phases.train_s,
            "tokens_per_s": co_tps,
            "predicted_tokens_per_s": phases.tokens
            / (phases.generate_s + phases.switch_s + phases.train_s),
            "staleness_mean": 0.0,
            "predicted_staleness_mean": 0.0,
            "predicted_step_s_fitted": phases.generate_s + phases.switch_s + phases.train_s,
        }
    ]
    for k in [int(x) for x in args.staleness.split(",")]:
        records = run(
            cfg,
            work / f"async_k{k}",
            args.procs,
            "rollout.placement.mode=async",
            f"parallel.rollout_ranks={half}",
            f"rollout.placement.max_staleness={k}",
        )
        pred = predict_async(scaling, half, args.procs - half, k, sync_s=phases.switch_s)
        pred_fit = predict_async(fitted, half, args.procs - half, k, sync_s=phases.switch_s)
        rows.append(
            {
                "mode": "async",
                "rollout_ranks": half,
                "trainers": args.procs - half,
                "max_staleness": k,
                "step_s": steady(records, "timing/step_s", args.warmup),
                "predicted_step_s": pred.step_s,
                "tokens_per_s": steady(records, "perf/tokens_per_s", args.warmup),
                "predicted_tokens_per_s": pred.tokens_per_s(phases.tokens),
                "staleness_mean": steady(records, "rollout/staleness_mean", args.warmup),
                "predicted_staleness_mean": pred.staleness_mean,
                "predicted_step_s_fitted": pred_fit.step_s,
                "sync_s": steady(records, "sync/seconds", args.warmup),
                "rollout_generate_s": steady(records, "rollout_group/generate_s", args.warmup),
                "rollout_wait_s": steady(records, "rollout_group/wait_s", args.warmup),
            }
        )
    for r in rows:
        r["speed_vs_colocated"] = co_step / r["step_s"]
        r["predicted_speed_vs_colocated"] = rows[0]["predicted_step_s"] / r["predicted_step_s"]
        r["predicted_speed_vs_colocated_fitted"] = (
            rows[0]["predicted_step_s_fitted"] / r["predicted_step_s_fitted"]
        )
    print(
        f"\ncolocated phases ({args.procs} processes, medians): generate {phases.generate_s:.3f} s,"
        f" switch {phases.switch_s:.3f} s, train {phases.train_s:.3f} s; on {half}: generate "
        f"{narrow.generate_s:.3f} s, train {narrow.train_s:.3f} s (fitted exponents: generate "
        f"{fitted.rollout_exponent:.2f}, train {fitted.train_exponent:.2f}; 1 = the even split)"
    )
    print("pred: the even split of each phase's work; fit: the fitted exponents")
    header = (
        f"{'run':<22}{'step s':>9}{'pred':>8}{'fit':>8}{'tok/s':>9}{'pred':>8}"
        f"{'x colo':>8}{'pred':>7}{'fit':>7}{'stale':>7}{'pred':>6}"
    )
    print(header)
    for r in rows:
        name = (
            "colocated"
            if r["mode"] == "colocated"
            else (f"async {r['rollout_ranks']}+{r['trainers']} k={r['max_staleness']}")
        )
        print(
            f"{name:<22}{r['step_s']:>9.3f}{r['predicted_step_s']:>8.3f}"
            f"{r['predicted_step_s_fitted']:>8.3f}{r['tokens_per_s']:>9.0f}"
            f"{r['predicted_tokens_per_s']:>8.0f}{r['speed_vs_colocated']:>8.2f}"
            f"{r['predicted_speed_vs_colocated']:>7.2f}"
            f"{r['predicted_speed_vs_colocated_fitted']:>7.2f}{r['staleness_mean']:>7.2f}"
            f"{r['predicted_staleness_mean']:>6.2f}"
        )
    write_results(
        "async",
        {
            "procs": args.procs,
            "steps": args.steps,
            "warmup": args.warmup,
            "phases": {
                "generate_s": phases.generate_s,
                "switch_s": phases.switch_s,
                "train_s": phases.train_s,
                "tokens": phases.tokens,
            },
            "phases_on_half": {"generate_s": narrow.generate_s, "train_s": narrow.train_s},
            "fitted_exponents": {
                "generate": fitted.rollout_exponent,
                "train": fitted.train_exponent,
            },
            "runs": rows,
        },
        smoke=args.smoke,
        peak_size=peak_size,
    )


if __name__ == "__main__":
    main()
