"""The rollout group's process: what a rollout rank of ``rollout.placement.mode: async`` builds and runs.

Reads the whole run configuration once, checks it against the trainers' layout, builds the
rollout engine, the links to the trainers and the prompts (on the group's first rank), and hands
:class:`~megarl.trainer.rollout_group.RolloutGroup` the sections it needs; then runs the group's
loop beside its two message threads until the trainers stop it.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import torch

from megarl import platform
from megarl.config import RunConfig, model_dtype, rollout_dtype
from megarl.config import validate as validate_config
from megarl.config.derived import routing_recorded
from megarl.data.chat import pad_token_id
from megarl.dtypes import dtype_from_name
from megarl.launch import init_split
from megarl.models.dims import ModelDims
from megarl.rollout.async_links import make_links, weight_schedule
from megarl.rollout.engine import check_rollout_model, make_rollout
from megarl.rollout.engine_folder import checkpoint_shapes
from megarl.rollout.engine_group import engine_group
from megarl.run.checks import check_inputs
from megarl.run.preemption import Preemption
from megarl.run.startup import layout_for
from megarl.run.watchdog import collective_timeout_s
from megarl.trainer.rollout_assembly import engine_config, multi_turn_maker, sampling_configs
from megarl.trainer.rollout_group import RolloutGroup
from megarl.trainer.rollout_group_parts import GroupSettings, Prompts
from megarl.trainer.trajectory_makers import OneReply
from megarl.weights.execute import hf_shapes_of
from megarl.weights.weight_sync import WeightReceiver

if TYPE_CHECKING:
    pass

ITEMSIZE = {"float32": 4, "bfloat16": 2}


def serve_rollouts(cfg: RunConfig) -> dict[str, float]:
    """The rollout group's program (entry point of a rollout rank in rollout.placement.mode=async)."""
    from transformers import AutoTokenizer

    world = init_split(cfg.parallel.rollout_ranks, collective_timeout_s(cfg.trainer.hang_timeout_s))
    split = world.split
    validate_config(cfg, split.world_size)
    trainers = layout_for(cfg.parallel, split.trainers, with_rollout=False)
    check_inputs(cfg, trainers)
    dims = ModelDims.from_pretrained(cfg.model.path)
    cuda = platform.device().type == "cuda"
    plan = weight_schedule(dims, trainers, ITEMSIZE[model_dtype(cfg.model, cuda)])
    expected = checkpoint_shapes(cfg.model.path)
    check_rollout_model(hf_shapes_of(plan.specs, dims), expected, dims.tie_word_embeddings)
    infer_tp = cfg.parallel.infer_tp or cfg.parallel.tp
    if not torch.cuda.is_available() and split.rollout_ranks == infer_tp:
        # one engine, no external launcher: vLLM's CPU build would pin its threads to cores of
        # its choosing, which the trainer processes on this machine use too
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    engine = make_rollout(
        cfg.rollout.engine.backend,
        cfg.model.path,
        infer_tp,
        engine_config(
            cfg.model,
            cfg.data,
            cfg.rollout,
            cfg.trainer.seed,
            split.local_rank(world.rank) // infer_tp,
            record_routes=routing_recorded(cfg.rollout.engine, dims.is_moe),
        ),
        expected,
    )
    links = make_links(world, plan, platform.distributed_backend())
    receiver = WeightReceiver(plan, dims, links.weights, device=platform.device())
    rank = split.local_rank(world.rank)
    prompts = None
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    if rank == 0:
        prompts = Prompts.build(cfg.data, cfg.reward, tokenizer, trainers.dp)
    sampling, val_sampling = sampling_configs(cfg.rollout.sampling, cfg.trainer.seed)
    settings = GroupSettings(
        cfg.rollout.placement,
        cfg.rollout.environment.max_env_failures,
        cfg.data,
        cfg.trainer,
        cfg.algorithm.filter_groups,
        dtype_from_name(rollout_dtype(cfg.model, cfg.rollout.engine, cuda)),
    )
    multi_turn = multi_turn_maker(
        cfg.rollout,
        cfg.model.path,
        cfg.data,
        cfg.trainer,
        tokenizer,
        pad_token_id(tokenizer) or 0,
        runs_environments=rank % infer_tp == 0,
        sampling=sampling,
    )
    group = RolloutGroup.build(
        settings,
        rank,
        split.rollout_ranks,
        engine,
        links,
        receiver,
        sampling,
        val_sampling,
        prompts,
        multi_turn or OneReply(cfg.rollout.placement.partial_chunk_tokens),
    )
    if multi_turn is not None:  # its engine's ranks share the first rank's results
        group.engine_group = engine_group(group.size, infer_tp, rank)  # this role's own world
    threads = [threading.Thread(target=group.link.receive_loop, name="megarl-control", daemon=True)]
    if group.leader:
        threads.append(
            threading.Thread(target=group.link.send_loop, name="megarl-send", daemon=True)
        )
    # a preemption signal is the trainers' to act on: they save (with the batch in flight) and
    # send Stop, which ends this loop; a second signal stops at once
    preemption = Preemption(world.rank)
    for t in threads:
        t.start()
    try:
        group.run()
    finally:
        preemption.close()
        group.trajectories.close()
    group.link.close()
    for t in threads:
        t.join(timeout=60.0)
    return {}


__all__ = ["serve_rollouts"]
