"""Wrap a model for training: megatron DDP (grad buffers) + the distributed optimizer + LR schedule."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec

import torch

from megarl.errors import ConfigError
from megarl.gpu_defaults import grad_reduce_overlap
from megarl.models.fused_adam import use_fused_adam
from megarl.models.grad_scale import use_in_place_grad_scaling


@dataclass(frozen=True)
class OptimSettings:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = True
    warmup_steps: int = 0
    total_steps: int = 1
    lr_decay_style: str = "constant"  # constant | linear | cosine
    # Share of optimizer states on the host (megatron's optimizer CPU offload; CUDA only)
    optimizer_offload: float = 0.0
    # With the offload, megatron's precision-aware optimizer: the fp32 main weights move to the
    # host with Adam's moments (False: megatron keeps them on the GPU, as without the option;
    # the GPU check measures that path where Transformer Engine is missing)
    precision_aware_offload: bool = True
    # DP grad reduction bucket by bucket during the backward pass; None: on with Transformer
    # Engine layers on CUDA (megarl.gpu_defaults), off elsewhere (it needs CUDA streams)
    overlap_grad_reduce: bool | None = None


def check_precision_aware_offload() -> None:
    """megatron-core 0.16.1's OptimizerConfig reads Transformer Engine's version for the
    precision-aware optimizer (and fails without TE): say so before it does."""
    if find_spec("transformer_engine") is None:
        raise ConfigError(
            "optimizer offload runs megatron's precision-aware optimizer (the fp32 main weights "
            "move to the host with Adam's moments), which megatron-core 0.16.1 checks against "
            "Transformer Engine's version: install Transformer Engine or set "
            "actor.optimizer_offload=0"
        )


def wrap_for_training(model, settings: OptimSettings):
    """Return ``(ddp_model, optimizer, lr_scheduler)`` for one model chunk on this rank.

    Grad reduction over DP (and the tied-embedding group under PP) runs through megatron's
    ``finalize_model_grads`` at the end of each forward-backward schedule.
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megarl.models.single_rank_sync import skip_single_rank_collectives

    config = model.config
    overlap = settings.overlap_grad_reduce
    if overlap is None:
        overlap = grad_reduce_overlap(config.transformer_impl, torch.cuda.is_available())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    skip_single_rank_collectives(ddp)  # DP1: no reduce-scatter / all-gather copies of the buffers
    config.finalize_model_grads_func = finalize_model_grads
    if overlap:
        # megatron's schedules hold the bucket reductions back until a mini-batch's last
        # micro-batch (no_sync) and start them as each bucket's grads are done (grad_sync); the
        # step's finalize_model_grads waits for them.
        config.no_sync_func = ddp.no_sync
        config.grad_sync_func = ddp.start_grad_sync
    offload = settings.optimizer_offload > 0
    if offload and settings.precision_aware_offload:
        check_precision_aware_offload()
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        optimizer_cpu_offload=offload,
        optimizer_offload_fraction=settings.optimizer_offload,
        # megatron's hybrid CPU/GPU optimizer then takes the 16-bit params and keeps their fp32
        # master copies itself, on the host for the offloaded share; without it the distributed
        # optimizer's fp32 main params stay on the GPU (Megatron-LM refuses the offload so)
        use_precision_aware_optimizer=offload and settings.precision_aware_offload,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    use_in_place_grad_scaling()  # clipping without a temporary copy of every grad
    use_fused_adam(optimizer)  # torch's one-pass Adam kernel where megatron uses torch's Adam
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.warmup_steps,
        lr_decay_steps=max(settings.total_steps, settings.warmup_steps + 1),
        lr_decay_style=settings.lr_decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=max(settings.total_steps, 1),
        wd_incr_style="constant",
    )
    return ddp, optimizer, scheduler
