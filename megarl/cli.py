"""``megarl`` command line: ``train`` (and ``train-rm``, ``train-sft``, ``train-dpo``), ``demo``,
``convert``, ``plan``, ``report``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from checkpoints_tools.cli import add_verbs
from megarl import __version__
from megarl.cluster.options import add_launcher_options
from megarl.console import START_ENV, announce, rank_env
from megarl.entry import main as rank_main
from megarl.errors import ConfigError, MegarlError
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.parked_rank import ParkedSlot, parked_rank
from megarl.plan.cli import add_arguments as add_plan_arguments
from megarl.plan.cli import run
from megarl.process_exit import end_process
from megarl.report import write_report
from megarl.run.run_lock import acquire_run_lock
from megarl.storage_errors import storage_error

if TYPE_CHECKING:
    from megarl.config import ParallelConfig, RolloutConfig, RunConfig


def _demo(args: argparse.Namespace) -> int:
    from megarl.launch import run_torchrun

    layout = ParallelLayout.for_world(args.nproc, tp=args.tp, pp=args.pp)
    if args.model not in ("tiny-qwen2", "tiny-llama", "smollm2"):
        layout.check_model(ModelDims.from_pretrained(args.model).shape)
    module_args = [
        "--model",
        args.model,
        "--tp",
        str(args.tp),
        "--pp",
        str(args.pp),
        "--seq",
        str(args.seq),
    ]
    return run_torchrun("megarl.tools.demo", module_args, args.nproc)


def _train(args: argparse.Namespace) -> int:
    from megarl.config import load_config

    overrides = [*args.overrides, *getattr(args, "forced", [])]
    cfg = load_config(args.config, overrides)  # config errors before any process starts
    # a one-process local job's rank starts now, beside the checks below (megarl.parked_rank)
    with parked_rank(
        _parks_a_rank(args, cfg.parallel, cfg.rollout), "megarl.entry", args.verbose
    ) as parked:
        return _checked_train(args, cfg, overrides, parked)


def _parks_a_rank(
    args: argparse.Namespace, parallel: ParallelConfig, rollout: RolloutConfig
) -> bool:
    """Whether this command will start one local rank itself (the launcher's own decision,
    made below, is the same where it can be made without torch)."""
    from megarl.config.derived import job_world_size

    launched = "RANK" in os.environ or "SLURM_STEP_ID" in os.environ  # megarl.launch
    return (
        not args.dry_run
        and not launched
        and args.launcher == "torchrun"
        and (args.nproc_per_node or job_world_size(parallel, rollout)) == 1
    )


def _checked_train(
    args: argparse.Namespace, cfg: RunConfig, overrides: list[str], parked: ParkedSlot
) -> int:
    from megarl.backends import this_machine
    from megarl.cluster.start import start_job, world_size
    from megarl.config import trainer_world_size, validate
    from megarl.config.advice import config_warnings
    from megarl.dry_run import before_launch, dry_run
    from megarl.gpu_defaults import default_nproc_per_node
    from megarl.launch import under_launcher
    from megarl.run.checks import check_choices, check_inputs
    from megarl.run.output_dir import check_output_dir, move_aside
    from megarl.run.startup import layout_for
    from megarl.run.verification import precheck_resume

    check_choices(cfg)  # loggers and algorithm names, through their registries
    for warning in config_warnings(cfg):
        print(f"megarl: warning: {warning}", file=sys.stderr)
    if args.dry_run:
        return dry_run(args, cfg)
    module_args = [args.config, *overrides]
    if under_launcher():  # already one of torchrun's / srun's ranks
        os.environ.update(rank_env(args.verbose))
        return rank_main(module_args)
    # one process per local GPU on CUDA (DP derived); on CPU tp * pp, plus the rollout group
    nproc = args.nproc_per_node or default_nproc_per_node(cfg.parallel, cfg.rollout, this_machine())
    world = world_size(args.launcher, args.nnodes, nproc, args.address)
    validate(cfg, world)
    colocated = cfg.rollout.placement.mode == "colocated"
    trainers = trainer_world_size(cfg.parallel, cfg.rollout, world)
    layout = layout_for(cfg.parallel, trainers, with_rollout=colocated)
    reward_model = check_inputs(cfg, layout)  # model folder, layout vs model, data, import paths
    # a live run in trainer.output_dir is refused; this one holds it until this process ends
    with acquire_run_lock(cfg.trainer.output_dir) as lock:
        move = check_output_dir(
            cfg.trainer
        )  # an earlier run in trainer.output_dir: refused, or moved
        if not move and cfg.trainer.resume == "auto":
            precheck_resume(Path(cfg.trainer.output_dir) / "checkpoints")  # refuses code in it
        refused = before_launch(args, cfg, nproc, world // nproc, reward_model)  # memory (CUDA)
        if refused:
            return refused
        if move:
            lock.moved_to(move_aside(cfg.trainer.output_dir))  # the lock stays in the new folder
            module_args.append("trainer.overwrite=false")  # a restarted rank must not move again
        # a one-process local job runs its rank directly (megarl.launch.run_torchrun)
        local = args.launcher == "torchrun" and world == 1
        announce(
            f"starting {world} rank(s) {'(one process)' if local else f'with {args.launcher}'}"
        )
        return start_job(
            cfg,
            module_args,
            layout,
            args.launcher,
            args.address,
            args.nnodes,
            args.verbose,
            extra_ranks=world - trainers,  # rollout.placement.mode=async: the rollout group
            parked=parked.take() if local else None,
        )


def _config(args: argparse.Namespace) -> int:
    from megarl.config.show import show

    if not args.show:
        raise ConfigError("megarl config: say what to do: --show prints every setting")
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not Path(path).is_file():  # an override, no file
        path, overrides = None, [path, *overrides]
    print(show(path, overrides))
    return 0


def _report(args: argparse.Namespace) -> int:

    out = write_report(args.run_dir, args.out)
    print(f"report written to {out}")
    return 0


def _plan(args: argparse.Namespace) -> int:

    return run(args)


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's and torch's log lines, known library warnings and torchrun's failure report",
    )


# `megarl VERB CONFIG`: the trainers of trainer.kind other than policy
SUPERVISED_VERBS = (
    ("train-rm", "reward_model", "train a reward model on preference pairs (Bradley-Terry)"),
    ("train-sft", "sft", "supervised fine-tuning on prompt/response rows or conversations"),
    ("train-dpo", "dpo", "direct preference optimisation (DPO and variants) on preference pairs"),
)


def add_preflight_arguments(parser: argparse.ArgumentParser) -> None:
    from megarl.plan.preflight import add_arguments

    add_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl", description="Megatron-core 3D-parallel RLHF engine"
    )
    parser.add_argument("--version", action="version", version=f"megarl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="build a model in TP/PP/DP and print its parity with transformers"
    )
    demo.add_argument(
        "--model", default="tiny-qwen2", help="tiny-qwen2 | tiny-llama | smollm2 | HF folder"
    )
    demo.add_argument("--nproc", type=int, default=4)
    demo.add_argument("--tp", type=int, default=2)
    demo.add_argument("--pp", type=int, default=2)
    demo.add_argument("--seq", type=int, default=32)
    demo.set_defaults(func=_demo)
    train = sub.add_parser(
        "train", help="run a PPO/GRPO config (YAML + section.key=value overrides)"
    )
    train.add_argument("config")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6")
    train.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="start torchrun with N local ranks (default: one per GPU on CUDA, tp*pp on CPU)",
    )
    _add_verbose(train)
    add_launcher_options(train)
    add_preflight_arguments(train)
    train.set_defaults(func=_train)
    for verb, kind, what in SUPERVISED_VERBS:
        sub_train = sub.add_parser(
            verb, help=f"{what}; the same as `train` with trainer.kind={kind}"
        )
        sub_train.add_argument("config")
        sub_train.add_argument(
            "overrides", nargs="*", help="dotted overrides, e.g. data.train_batch_size=64"
        )
        sub_train.add_argument(
            "--nproc-per-node",
            type=int,
            default=None,
            help="start torchrun with N local ranks (default: one per GPU on CUDA, tp*pp on CPU)",
        )
        _add_verbose(sub_train)
        add_launcher_options(sub_train)
        add_preflight_arguments(sub_train)
        sub_train.set_defaults(func=_train, forced=[f"trainer.kind={kind}"])

    convert = sub.add_parser(
        "convert",
        help="Megatron dist checkpoints <-> Hugging Face (hf-to-mcore, mcore-to-hf, verify)",
    )
    add_verbs(convert)

    plan = sub.add_parser(
        "plan", help="which TP/PP/DP layouts fit a model on N GPUs, memory per GPU, step time"
    )
    add_plan_arguments(plan)
    plan.set_defaults(func=_plan)
    config = sub.add_parser(
        "config", help="every setting with its value (CONFIG + overrides) and its default"
    )
    config.add_argument(
        "--show", action="store_true", help="print every setting, its value and its default"
    )
    config.add_argument("config", nargs="?", default=None, help="a run's YAML (optional)")
    config.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.sampling.n=8")
    config.set_defaults(func=_config)
    report = sub.add_parser(
        "report",
        help="plots of a run's metrics (OUTPUT/metrics.jsonl) as one HTML page, no server needed",
    )
    report.add_argument("run_dir", help="the run's trainer.output_dir")
    report.add_argument("--out", default=None, help="HTML file (default: RUN_DIR/report.html)")
    report.set_defaults(func=_report)
    return parser


# Verbs whose positional arguments end with ``key=value`` overrides, which may come anywhere on
# the command line (before, between or after the options).
OVERRIDE_VERBS = ("train", "train-rm", "config")


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with a training verb's overrides taken wherever they stand."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in OVERRIDE_VERBS:
        stray = [a for a in rest if a.startswith("-") or "=" not in a]
        if stray:
            parser.error(f"unrecognized arguments: {' '.join(stray)}")
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ[START_ENV] = str(time.time())  # the start-up lines count from the command
    args = parse(argv)
    try:
        return int(args.func(args) or 0)
    except MegarlError as e:
        print(f"megarl: error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # a full disk or a folder it may not write, met by the command itself
        told = storage_error(e)
        if told is None:
            raise
        print(f"megarl: error: {told}", file=sys.stderr)
        return told.exit_code


def command() -> None:
    """The ``megarl`` command: :func:`main`, then the process ends without the interpreter's
    teardown (megarl.process_exit; its ranks have ended by then). A command that used Ray ends
    normally: Ray's exit handlers stop the local instance it may have started."""
    code = main()
    if "ray" in sys.modules:
        raise SystemExit(code)
    end_process(code)


if __name__ == "__main__":
    command()
