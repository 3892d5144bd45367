"""The planner's memory check for an elastic restart's layout on GPUs (megarl/plan/memory.py):
the peak per GPU of the run's own settings at that layout, against the device's memory."""

from __future__ import annotations

from megarl.cluster.layouts import FitCheck
from megarl.config import RunConfig
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.plan.memory import GPU_BF16, Options, estimate_memory
from megarl.plan.units import fmt_gib
from megarl.plan.workload import Workload


def run_workload(cfg: RunConfig) -> Workload:
    """What one optimizer step of ``cfg`` asks of the machine, as the planner models it."""
    a = cfg.algorithm
    seq = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    return Workload(
        seq_len=seq,
        micro_batch=cfg.actor.micro_batch_size,
        global_batch=cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
        algo="ppo" if a.adv_estimator == "gae" else "grpo",
        reference=a.use_kl_loss or a.use_kl_in_reward,
        response_len=cfg.rollout.max_response_length,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        lora_rank=cfg.actor.lora.rank,
    )


def run_options(cfg: RunConfig) -> Options:
    return Options(
        recompute=cfg.model.recompute,
        sequence_parallel=cfg.parallel.sequence_parallel,
        optimizer_offload=cfg.actor.optimizer_offload > 0,
        param_offload=cfg.actor.param_offload,
        packing=cfg.actor.packing,
    )


def gpu_memory_check(dims: ModelDims, gpu_memory: int) -> FitCheck:
    def fits(cfg: RunConfig, layout: ParallelLayout) -> str | None:
        workload = run_workload(cfg)
        memory = estimate_memory(
            dims, layout, workload, GPU_BF16, run_options(cfg), gpu_memory=gpu_memory
        )
        if memory.peak <= gpu_memory:
            return None
        return (
            f"{layout}: the planner's peak {fmt_gib(memory.peak)} GiB per GPU exceeds the "
            f"device's {fmt_gib(gpu_memory)} GiB"
        )

    return fits
