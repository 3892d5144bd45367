"""``megarl train CONFIG --dry-run`` and the same memory preflight before a CUDA launch.

The dry run makes the launch's own checks (config, batch split over the data-parallel ranks,
layout against the model's ``config.json``, reward model, data file footers) for the machines
named by ``--gpus-per-node``, ``--nnodes``, ``--gpu-memory`` and ``--host-memory``, then prints
the planned memory per GPU of every phase (:mod:`megarl.plan.preflight`). No model is built and
no process is started. Unnamed numbers come from this machine where it has CUDA, else they are
assumed (8 GPUs of 80 GiB per node, 1 TiB of host memory) and said to be.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from megarl.backends import this_machine
from megarl.config import (
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
    trainer_world_size,
    validate,
)
from megarl.gpu_defaults import Target, check_for_target
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.plan.preflight import (
    DEFAULT_GPU_MEMORY,
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_HOST_MEMORY,
    Hardware,
    Preflight,
    format_report,
    preflight,
    summary,
)
from megarl.plan.units import parse_bytes
from megarl.run.checks import check_inputs

EXIT_DOES_NOT_FIT = 2


def _host_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def hardware_for(args: argparse.Namespace, machine: Target) -> Hardware:
    """The machines named on the command line; unnamed numbers from this CUDA machine, else the
    defaults (marked assumed)."""
    sources = []
    gpus = args.gpus_per_node
    if gpus is None:
        gpus = machine.local_gpus if machine.cuda else DEFAULT_GPUS_PER_NODE
        sources.append(("gpus", "this machine" if machine.cuda else "assumed: --gpus-per-node"))
    if args.gpu_memory is not None:
        gpu_memory = parse_bytes(args.gpu_memory, "--gpu-memory")
    elif machine.cuda:
        gpu_memory = torch.cuda.get_device_properties(0).total_memory
        sources.append(("gpu_memory", "this machine"))
    else:
        gpu_memory = DEFAULT_GPU_MEMORY
        sources.append(("gpu_memory", "assumed: --gpu-memory"))
    if args.host_memory is not None:
        host_memory = parse_bytes(args.host_memory, "--host-memory")
    elif machine.cuda:
        host_memory = _host_ram()
        sources.append(("host_memory", "this machine"))
    else:
        host_memory = DEFAULT_HOST_MEMORY
        sources.append(("host_memory", "assumed: --host-memory"))
    return Hardware(
        gpus_per_node=gpus,
        nnodes=args.nnodes or 1,
        gpu_memory=gpu_memory,
        host_memory=host_memory,
        sources=tuple(sources),
    )


def _layout(parallel: ParallelConfig, rollout: RolloutConfig, world: int) -> ParallelLayout:
    """The trainers' layout over a job of ``world`` ranks (in rollout.placement.mode=async, the ranks left
    beside the rollout group, which do not roll out)."""
    colocated = rollout.placement.mode == "colocated"
    return ParallelLayout.for_settings(
        trainer_world_size(parallel, rollout, world), parallel, colocated
    )


def not_planned(trainer: TrainerConfig, rollout: RolloutConfig) -> str | None:
    """Why the memory preflight cannot plan a run of these settings (None: it can)."""
    if trainer.kind != "policy":
        return (
            f"the memory preflight models policy runs (trainer.kind=policy), not "
            f"trainer.kind={trainer.kind}"
        )
    if rollout.placement.mode == "async":
        return (
            "the memory preflight models colocated runs (vLLM beside the models on every GPU), "
            "not rollout.placement.mode=async (trainer ranks without vLLM, parallel.rollout_ranks ranks "
            "with vLLM only), so this job's memory per GPU is not planned"
        )
    return None


def _checked(
    cfg: RunConfig, hardware: Hardware, target: Target, here: bool, config_name: str
) -> Preflight:
    """The launch's checks for this world (and for the target machine: its refusals), then the
    preflight."""
    check_for_target(cfg.model, cfg.actor, target)
    validate(cfg, hardware.world)
    reward_model = check_inputs(
        cfg, _layout(cfg.parallel, cfg.rollout, hardware.world), this_machine=here
    )
    dims = ModelDims.from_pretrained(cfg.model.path)
    return preflight(cfg, dims, hardware, target, reward_model, config_name=config_name)


def dry_run(args: argparse.Namespace, cfg: RunConfig) -> int:
    """Print the preflight of ``cfg`` for the named machines; 0 when every phase fits, else 2."""
    machine = this_machine()
    hardware = hardware_for(args, machine)
    target = machine if machine.cuda else Target.gpu_node(hardware.gpus_per_node)
    reason = not_planned(cfg.trainer, cfg.rollout)
    if reason:
        validate(cfg, hardware.world)
        check_inputs(
            cfg, _layout(cfg.parallel, cfg.rollout, hardware.world), this_machine=machine.cuda
        )
        print(f"megarl preflight: config checks passed; {reason}")
        return 0
    pf = _checked(cfg, hardware, target, machine.cuda, args.config)
    if not machine.cuda:
        pf.notes.append(
            "planned for a CUDA node as scripts/setup.sh installs it (Transformer Engine, no "
            "apex); on such a node `megarl train` runs this check itself before launch"
        )
    print(format_report(pf))
    return 0 if pf.fits else EXIT_DOES_NOT_FIT


def before_launch(
    args: argparse.Namespace,
    cfg: RunConfig,
    nproc: int,
    nnodes: int,
    reward_model: ModelDims | None,
) -> int:
    """On CUDA (unless ``--no-preflight``): the preflight for ``nnodes`` nodes of ``nproc`` GPUs
    like this machine's, after the launch's input checks (``reward_model``: the shape they read);
    0 to launch, 2 (the report printed) when a phase does not fit or, in rollout.placement.mode=async,
    cannot be planned."""
    machine = this_machine()
    if not machine.cuda or args.no_preflight or cfg.trainer.kind != "policy":
        return 0
    reason = not_planned(cfg.trainer, cfg.rollout)
    if reason:
        print(
            f"megarl: error: {reason}; start it with --no-preflight to launch without the "
            "memory check, or use rollout.placement.mode=colocated",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_DOES_NOT_FIT
    hardware = hardware_for(
        argparse.Namespace(**{**vars(args), "gpus_per_node": nproc, "nnodes": nnodes}), machine
    )
    dims = ModelDims.from_pretrained(cfg.model.path)
    pf = preflight(cfg, dims, hardware, machine, reward_model, config_name=args.config)
    print(summary(pf), file=sys.stdout if pf.fits else sys.stderr, flush=True)
    return 0 if pf.fits else EXIT_DOES_NOT_FIT
