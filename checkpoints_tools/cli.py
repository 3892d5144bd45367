"""``python -m checkpoints_tools <verb>`` and ``megarl convert <verb>``.

Verbs:
  hf-to-mcore  --hf DIR --out DIR [--tp N --pp M --ep E] [--role actor|critic] [--dtype auto|...]
  mcore-to-hf  --ckpt DIR --out DIR [--dtype float32|bfloat16] [--nproc N] [--lora merged|adapter]
               (DIR: a checkpoint, a training step folder, or a run's checkpoints/ folder; its
               manifest is verified first, and every exported tensor must be finite)
  verify       --hf DIR --ckpt DIR [--tp N --pp M --ep E] [--no-logits]

Everything a user can get wrong is checked here, before any process starts; errors print one
message naming the fix and exit with 2. ``verify`` exits with 1 when the folders differ.
Verbs that need several processes re-launch this module under torchrun (``tp*pp*ep`` ranks).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from megarl.errors import CheckpointError, ConfigError, MegarlError
from megarl.parallel import ParallelLayout
from megarl.ports import free_port

PROG = "python -m checkpoints_tools"
MODULE = "checkpoints_tools"


def _size(text: str) -> int:
    units = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1}
    t = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * units[unit])
    return int(t)


def _in_world(nproc: int, verb_argv: list[str], body: Callable[[], int]) -> int:
    """Run ``body`` with torch.distributed initialised over ``nproc`` ranks.

    Under a launcher (torchrun, srun) it runs here; with ``nproc == 1`` it starts a
    one-process group here; otherwise it re-launches this module under torchrun.
    """
    import torch.distributed as dist

    from megarl.launch import init_distributed, run_torchrun, under_launcher

    if not under_launcher():
        if nproc > 1:
            if "MASTER_PORT" not in os.environ:
                os.environ["MASTER_PORT"] = str(free_port())
            return run_torchrun(MODULE, verb_argv, nproc)
        os.environ.update(
            MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
        )
    init_distributed()
    try:
        return body()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


# ---------------------------------------------------------------------------------------------


def _cmd_hf_to_mcore(args: argparse.Namespace) -> int:
    from checkpoints_tools.hf_to_mcore import check_hf_source, hf_to_mcore
    from megarl.checkpoint.store import check_destination, check_not_inside
    from megarl.launch import under_launcher

    layout = ParallelLayout(tp=args.tp, pp=args.pp, dp=args.ep, ep=args.ep)
    source = check_hf_source(args.hf, layout, args.role, args.dtype)
    check_not_inside(args.out, args.hf, "Hugging Face folder")
    if not under_launcher():
        check_destination(args.out, args.overwrite)
    argv = ["hf-to-mcore", "--hf", str(args.hf), "--out", str(args.out)]
    argv += ["--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep)]
    argv += ["--dtype", source.dtype]
    argv += ["--role", source.role] + (["--overwrite"] if args.overwrite else [])

    def body() -> int:
        import torch.distributed as dist

        world = dist.get_world_size()
        hf_to_mcore(
            source,
            args.out,
            ParallelLayout.for_world(world, args.tp, args.pp, ep=args.ep),
            overwrite=args.overwrite,
        )
        return 0

    return _in_world(layout.world_size, argv, body)


def _cmd_mcore_to_hf(args: argparse.Namespace) -> int:
    from checkpoints_tools.lora_export import check_lora_export
    from checkpoints_tools.mcore_to_hf import export_to_hf
    from megarl.checkpoint.store import (
        check_destination,
        check_not_inside,
        read_meta,
        resolve_checkpoint,
        step_roles,
    )
    from megarl.dtypes import dtype_from_name
    from megarl.launch import under_launcher

    ckpt = resolve_checkpoint(args.ckpt)  # a run's checkpoints/, a step folder or a role folder
    if ckpt != Path(args.ckpt).absolute() and ckpt != Path(args.ckpt):
        others = [r for r in step_roles(ckpt.parent) if r != ckpt.name]
        also = f"; pass {ckpt.parent / others[0]} for its {others[0]}" if others else ""
        print(f"mcore-to-hf: exporting {ckpt} ({ckpt.name} of {ckpt.parent.name}{also})")
    args.ckpt = str(ckpt)
    if not args.verified:  # (the ranks this command relaunches under torchrun: checked here)
        check_intact(ckpt)  # a damaged checkpoint is refused before anything is read from it
    meta = read_meta(ckpt)  # missing / partial checkpoints fail here, before any work
    check_lora_export(meta, args.lora, ckpt)
    check_not_inside(args.out, ckpt, "checkpoint")
    if args.dtype:
        dtype_from_name(args.dtype)
    if not under_launcher():
        check_destination(args.out, args.overwrite)
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")

    def body() -> int:
        result = export_to_hf(
            args.ckpt,
            args.out,
            dtype=args.dtype,
            max_shard_bytes=args.max_shard_size,
            overwrite=args.overwrite,
            progress=not args.quiet,
            lora=args.lora,
        )
        if _rank() == 0:
            kind = {
                "critic": "token classification (value head as `score`)",
                "reward": "sequence classification (reward head as `score`)",
            }.get(meta.role, "causal LM")
            print(
                f"mcore-to-hf: {args.ckpt} -> {result.out}: {result.tensors} tensors, "
                f"{result.bytes / 2**20:.1f} MiB {result.dtype} in {result.files} file(s), "
                f"{kind}, {result.seconds:.1f}s"
            )
        return 0

    if args.nproc == 1 and not under_launcher():
        return body()
    argv = ["mcore-to-hf", "--ckpt", str(args.ckpt), "--out", str(args.out), "--verified"]
    argv += ["--max-shard-size", str(args.max_shard_size)]
    argv += (["--dtype", args.dtype] if args.dtype else []) + (
        ["--overwrite"] if args.overwrite else []
    )
    argv += ["--quiet"] if args.quiet else []
    argv += ["--lora", args.lora] if args.lora else []
    return _in_world(args.nproc, argv, body)


def check_intact(ckpt: Path) -> None:
    """Every file of ``ckpt`` against its manifest (sizes and checksums); a CheckpointError
    naming the damaged files."""
    import megarl.checkpoint.manifest as manifest

    problems = manifest.verify(ckpt)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(
            f"checkpoint {ckpt} is damaged: {'; '.join(problems[:3])}{more}. Nothing was "
            "exported; use an intact copy, or an earlier checkpoint of the run"
        )
    if manifest.read(ckpt) is None:
        print(
            f"note: {ckpt} has no manifest (saved by an older megarl): its files are not verified",
            file=sys.stderr,
        )


def _cmd_verify(args: argparse.Namespace) -> int:
    from checkpoints_tools.verify import compare_outputs, compare_tensors, start_report
    from megarl.checkpoint.store import checkpoint_dims

    report = start_report(args.hf, args.ckpt, args.rtol)
    layout = ParallelLayout(tp=args.tp, pp=args.pp, dp=args.ep, ep=args.ep)
    layout.check_model(checkpoint_dims(report.ckpt).shape)

    def tensors() -> None:
        report.tensors, report.hf_dtype = compare_tensors(args.hf, args.ckpt)

    if args.no_logits:
        tensors()
    else:
        argv = ["verify", "--hf", str(args.hf), "--ckpt", str(args.ckpt)]
        argv += ["--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep)]
        argv += ["--rtol", str(args.rtol)]
        argv += ["--batch", str(args.batch), "--seq", str(args.seq)]

        def body() -> int:
            if _rank() == 0:
                tensors()
            report.logits = compare_outputs(
                args.hf, args.ckpt, layout, batch=args.batch, seq=args.seq
            )
            return 0 if _rank() != 0 else _print(report)

        return _in_world(layout.world_size, argv, body)
    return _print(report)


def _print(report) -> int:
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


# ---------------------------------------------------------------------------------------------


def add_verbs(parser: argparse.ArgumentParser) -> None:
    """Add the conversion verbs to ``parser`` (this module's CLI and ``megarl convert``)."""
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    p = sub.add_parser(
        "hf-to-mcore",
        help="Hugging Face safetensors folder -> megatron dist checkpoint (+ config, tokenizer)",
        description="Runs on tp*pp processes (torchrun, started for you), each reading only its "
        "slices. The checkpoint loads at any other TP/PP.",
    )
    p.add_argument("--hf", required=True, help="Hugging Face model folder (safetensors)")
    p.add_argument("--out", required=True, help="checkpoint folder to create")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the conversion")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the conversion")
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size (MoE models; tp*pp*ep ranks)"
    )
    p.add_argument(
        "--role",
        choices=["actor", "critic", "reference", "reward"],
        default=None,
        help="model role (default: critic for a *ForTokenClassification folder, reward for a "
        "*ForSequenceClassification one, else actor); a critic or reward model made from a causal "
        "LM starts with a fresh head",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="parameter dtype of the checkpoint (auto: the config's dtype)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=_cmd_hf_to_mcore)

    p = sub.add_parser(
        "mcore-to-hf",
        help="megatron dist checkpoint -> Hugging Face folder (transformers and vLLM load it)",
        description="Streams tensor by tensor from the checkpoint (any saved TP/PP) into "
        "safetensors shards: memory stays at about one tensor (embeddings and LM heads: one "
        "saved chunk). A critic exports as *ForTokenClassification, a reward model as "
        "*ForSequenceClassification, with one label.",
    )
    p.add_argument(
        "--ckpt",
        required=True,
        help="checkpoint folder: a role folder, a training step_N folder (its actor, else its "
        "reward model) or a run's checkpoints/ folder (follows `latest`)",
    )
    p.add_argument("--out", required=True, help="Hugging Face folder to create")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the exported weights (default: the checkpoint's)",
    )
    p.add_argument(
        "--max-shard-size",
        type=_size,
        default="2GiB",
        help="largest safetensors file (default 2GiB)",
    )
    p.add_argument("--nproc", type=int, default=1, help="processes sharing the files (torchrun)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verified", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--lora",
        default=None,
        choices=["merged", "adapter"],
        help="a checkpoint with LoRA adapters: `merged` writes the model with the adapters "
        "merged into its weights, `adapter` a peft adapter folder (adapter_config.json + "
        "adapter_model.safetensors) for the base model",
    )
    p.set_defaults(func=_cmd_mcore_to_hf)

    p = sub.add_parser(
        "verify",
        help="compare a Hugging Face folder with a checkpoint: every tensor, and logits",
        description="Exits 0 when every tensor is bit-identical and the logits agree, 1 if not.",
    )
    p.add_argument("--hf", required=True, help="Hugging Face model folder")
    p.add_argument("--ckpt", required=True, help="checkpoint folder (or a root with `latest`)")
    p.add_argument("--tp", type=int, default=1, help="TP of the megatron model for the logits")
    p.add_argument("--pp", type=int, default=1, help="PP of the megatron model for the logits")
    p.add_argument("--ep", type=int, default=1, help="EP of the megatron model (MoE models)")
    p.add_argument(
        "--rtol",
        type=float,
        default=1e-4,
        help="allowed max |logit diff| relative to max |logit| (default 1e-4)",
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument(
        "--no-logits",
        action="store_true",
        help="compare tensors only (streams; no model in memory)",
    )
    p.set_defaults(func=_cmd_verify)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Megatron dist checkpoints <-> Hugging Face, verified"
    )
    add_verbs(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed verb; user errors print their message and return 2."""
    try:
        return int(args.func(args) or 0)
    except MegarlError as e:
        print(f"{PROG} {args.verb}: error: {e}", file=sys.stderr)
        return e.exit_code


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
