"""Start-up of a rank: process group, layout, config and input checks, model-parallel groups,
seed and tokenizer; the same for both trainers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megarl.config import ParallelConfig, RunConfig
from megarl.config import validate as validate_config
from megarl.console import announce
from megarl.data.chat import pad_token_id
from megarl.launch import init_distributed, init_split
from megarl.parallel import ParallelLayout, initialize_model_parallel
from megarl.run.checks import check_inputs
from megarl.run.output_dir import prepare_output_dir
from megarl.run.resolved_config import write_resolved_config
from megarl.run.watchdog import collective_timeout_s
from megarl.startup_heap import freeze_startup_heap
from megarl.world_split import SplitWorld

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Startup:
    """A started rank: its layout, its global rank, and the policy's tokenizer."""

    layout: ParallelLayout
    rank: int
    tokenizer: PreTrainedTokenizerBase
    pad_id: int
    # rollout.placement.mode=async: the job split into trainers (this world) and the rollout group
    world: SplitWorld | None = None


def layout_for(parallel: ParallelConfig, world: int, *, with_rollout: bool) -> ParallelLayout:
    """The training layout of ``parallel`` over ``world`` ranks (with the rollout's TP when it
    rolls out)."""
    return ParallelLayout.for_settings(world, parallel, with_rollout)


def start(cfg: RunConfig, *, with_rollout: bool) -> Startup:
    """Everything before the first model is built; the cheap checks come before any heavy work."""
    from transformers import AutoTokenizer

    timeout_s = collective_timeout_s(cfg.trainer.hang_timeout_s)
    split = None
    if with_rollout and cfg.rollout.placement.mode == "async":  # this world: the trainers only
        split = init_split(cfg.parallel.rollout_ranks, timeout_s)
        rank, world = split.split.local_rank(split.rank), split.split.trainers
        job = split.split.world_size
        with_rollout = False
    else:
        rank, world = init_distributed(timeout_s)
        job = world
    if split is None:
        announce(f"started {world} rank(s); checking the inputs")
    else:
        announce(
            f"started {job} rank(s): {world} training, {job - world} generating rollouts; "
            "checking the inputs"
        )
    layout = layout_for(cfg.parallel, world, with_rollout=with_rollout)
    validate_config(cfg, job)
    check_inputs(cfg, layout)
    prepare_output_dir(
        cfg.trainer, rank
    )  # an earlier run in trainer.output_dir: refused or moved aside
    write_resolved_config(cfg, rank)  # OUT/config.yaml: every setting this run uses
    initialize_model_parallel(layout, seed=cfg.trainer.seed, timeout_s=timeout_s)
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    freeze_startup_heap()  # the libraries are imported; no model or data exists yet
    return Startup(layout, rank, tokenizer, pad_token_id(tokenizer) or 0, split)
