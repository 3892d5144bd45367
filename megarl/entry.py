"""Rank entry point of ``megarl train``: ``python -m megarl.entry CONFIG.yaml [key=value ...]``
under torchrun or Slurm srun (``megarl train --nproc-per-node N`` starts torchrun itself)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from megarl.console import quiet_rank_console
from megarl.errors import MegarlError
from megarl.hardening import make_undumpable
from megarl.lean_imports import import_megatron_lean, import_transformers_lean
from megarl.parent_death import end_with_parent
from megarl.parked_rank import GO_FD_ENV, await_go
from megarl.peer_loss import PEER_LOST_EXIT, peer_lost
from megarl.process_exit import end_process
from megarl.startup_heap import CollectionPaused, freeze_startup_heap
from megarl.storage_errors import storage_error

if TYPE_CHECKING:
    from megarl.config import RunConfig

Trainer = Callable[["RunConfig"], dict[str, float]]


def _policy() -> Trainer:
    from megarl.trainer.loop import train

    return train


def _reward_model() -> Trainer:
    from megarl.reward_model.train import REWARD_MODEL
    from megarl.run.supervised import train_supervised

    return partial(train_supervised, kind=REWARD_MODEL)


def _rollout_group() -> Trainer:
    from megarl.trainer.serve_rollouts import serve_rollouts

    return serve_rollouts


def _sft() -> Trainer:
    from megarl.run.supervised import train_supervised
    from megarl.sft.train import SFT

    return partial(train_supervised, kind=SFT)


def _dpo() -> Trainer:
    from megarl.dpo.train import DPO
    from megarl.run.supervised import train_supervised

    return partial(train_supervised, kind=DPO)


# trainer.kind -> the function that runs such a config (imported lazily: each pulls in megatron)
TRAINERS: dict[str, Callable[[], Trainer]] = {
    "policy": _policy,
    "reward_model": _reward_model,
    "sft": _sft,
    "dpo": _dpo,
}


def program(cfg: RunConfig) -> Trainer:
    """What this rank runs: the trainer of ``trainer.kind``, or in rollout.placement.mode=async on the
    last parallel.rollout_ranks ranks the rollout group; imported with the libraries it uses
    from its start (megatron-core for a trainer)."""
    if cfg.trainer.kind == "policy" and cfg.rollout.placement.mode == "async":
        from megarl.launch import job_split
        from megarl.world_split import ROLLOUT

        if job_split(cfg.parallel.rollout_ranks).role(int(os.environ["RANK"])) == ROLLOUT:
            return _rollout_group()
    import_megatron_lean()  # every trainer builds megatron models (megarl.lean_imports)
    return TRAINERS[cfg.trainer.kind]()


def main(argv: list[str] | None = None) -> int:
    make_undumpable()  # before anything reads the config, its secrets or the environment's
    end_with_parent()  # a rank ends with its launcher, however the launcher ends
    # no automatic garbage collection while the rank imports its libraries (megarl.startup_heap)
    with CollectionPaused() as imports:
        return _run(argv, imports)


def _run(argv: list[str] | None, imports: CollectionPaused) -> int:
    from megarl.config import load_config

    quiet_rank_console()  # before torch, megatron or vLLM are imported
    from megarl.backends import set_rank_env
    from megarl.run.preemption import stop_exit_code  # imports torch

    args = list(sys.argv[1:] if argv is None else argv)
    if GO_FD_ENV in os.environ:  # started early by `megarl train` (megarl.parked_rank)
        import_transformers_lean()
        import_megatron_lean()  # what every rank imports, while the launcher checks the run
        args = await_go()
    if not args:
        print(
            "usage: python -m megarl.entry CONFIG.yaml [section.key=value ...]",
            file=sys.stderr,
        )
        return 2
    output_dir: str | None = None
    try:
        cfg = load_config(args[0], args[1:])
        output_dir = cfg.trainer.output_dir
        set_rank_env(
            cfg.model, cfg.parallel, cfg.actor
        )  # e.g. CUDA_DEVICE_MAX_CONNECTIONS, before CUDA initialises
        import_transformers_lean()  # before the first tokenizer (megarl.lean_imports)
        trainer = program(cfg)  # imported, with the libraries it uses from its start
        freeze_startup_heap()  # their objects: out of every later collection's way
        imports.resume()
        trainer(cfg)
    except MegarlError as e:
        print(f"megarl: error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # a full disk or a folder it may not write: one line, not a traceback
        told = storage_error(e, output_dir)
        if told is not None:
            print(f"megarl: error: {told}", file=sys.stderr)
            return told.exit_code
        lost = peer_lost(e)  # another rank ended: its own message says why, not this traceback
        if lost is None:
            raise
        print(f"megarl: {lost}", file=sys.stderr)
        return PEER_LOST_EXIT
    return stop_exit_code()  # 130 when a Ctrl-C stopped the run (after its checkpoint)


if __name__ == "__main__":
    # a rank process: once the program has returned, no interpreter teardown (megarl.process_exit)
    end_process(main())
