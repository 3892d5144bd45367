"""What a run gets on its machine where the config says nothing, and what is refused there.

Every decision here is a pure function of the config and a :class:`Target` (the machine: CUDA or
not, which optional kernels import there), so each is unit-tested on a CPU by naming the target.
:func:`megarl.backends.this_machine` probes this machine; :meth:`Target.gpu_node` is the CUDA node that
``scripts/setup.sh`` installs (CUDA, Transformer Engine, no apex), which ``megarl train
--dry-run`` plans for on a machine without a GPU.

On a CUDA target:

- ``model.dtype: auto`` (the default) is bfloat16; on CPU it is float32;
- Transformer Engine layers (``model.transformer_impl: auto`` where TE imports) get TE's fused
  rope (``apply_rope_fusion``: megatron's unfused packed rope syncs with the host in every
  layer), the gradient-accumulation fusion (weight gradients accumulated straight into the fp32
  grad buffer; megatron's output layer needs apex's ``fused_weight_gradient_mlp_cuda`` for it, so
  it is on only where that imports), overlapped DP grad reduction (bucket by bucket during the
  backward pass) and, for a mixture of experts, grouped GEMM over each layer's local experts
  (megatron's ``TEGroupedMLP``: one kernel where the sequential experts launch one per expert);
- ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in every rank's environment where megatron relies on kernel
  order for overlapping communication: tensor parallelism (sequence-parallel all-gathers and
  reduce-scatters, asynchronous dgrad all-reduce) and overlapped grad reduction;
- ``megarl train`` starts one process per local GPU (DP derived); on CPU ``tp * pp``.

Refused on a CUDA target (before launch): fp32 weights with Transformer Engine and packing. TE has
no attention kernel for packed (THD) batches in fp32: its fused and flash backends need 16-bit
inputs and its unfused backend refuses THD. Optimizer offload without Transformer Engine:
megarl offloads through megatron's precision-aware optimizer, which moves the fp32 main weights
with Adam's moments, and megatron-core 0.16.1 checks that option against TE's version (without
TE it fails; without the option megatron keeps the main weights on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config import (
    ActorConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    job_world_size,
    model_dtype,
)
from megarl.errors import ConfigError

# Where megarl sets CUDA_DEVICE_MAX_CONNECTIONS (a user's own value is kept).
MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


@dataclass(frozen=True)
class Target:
    """The machine a run is decided for."""

    cuda: bool
    transformer_engine: bool = False  # transformer_engine.pytorch imports
    # apex's fused_weight_gradient_mlp_cuda imports: megatron's output layer (a plain
    # ColumnParallelLinear, also under the TE spec) refuses gradient_accumulation_fusion without it
    wgrad_fusion_kernel: bool = False
    local_gpus: int = 0  # CUDA devices one node has

    @classmethod
    def gpu_node(cls, gpus: int = 8) -> Target:
        """A CUDA node as ``scripts/setup.sh`` installs it: Transformer Engine, no apex."""
        return cls(cuda=True, transformer_engine=True, local_gpus=gpus)


def transformer_impl(requested: str, target: Target, lora: bool = False) -> str:
    """``local`` or ``transformer_engine`` for ``model.transformer_impl`` on ``target``; raises
    where TE is requested and cannot run. ``auto``: TE where CUDA and TE are present, except for a
    LoRA actor (its adapters wrap megatron's own parallel linears)."""
    if requested == "transformer_engine":
        if not target.cuda:
            raise ConfigError(
                "model.transformer_impl=transformer_engine needs CUDA, and this machine has no "
                "GPU; use model.transformer_impl=local (or auto) on CPU"
            )
        if not target.transformer_engine:
            raise ConfigError(
                "model.transformer_impl=transformer_engine, but Transformer Engine is not "
                "installed; install it as scripts/setup.sh does (pip install --no-build-isolation "
                "'transformer-engine[pytorch]') or use model.transformer_impl=local"
            )
        return "transformer_engine"
    if requested == "auto" and target.cuda and target.transformer_engine and not lora:
        return "transformer_engine"
    return "local"


@dataclass(frozen=True)
class KernelOptions:
    """The fused kernels and overlaps a model gets (megatron TransformerConfig / DDP settings)."""

    bias_activation_fusion: bool
    masked_softmax_fusion: bool
    bias_dropout_fusion: bool
    apply_rope_fusion: bool
    gradient_accumulation_fusion: bool
    overlap_grad_reduce: bool
    # MoE experts as one grouped GEMM per layer (Transformer Engine's GroupedLinear, megatron's
    # TEGroupedMLP) instead of one GEMM per local expert (SequentialMLP); the build sets it for
    # MoE models only
    moe_grouped_gemm: bool = False

    def transformer_config(self) -> dict[str, bool]:
        """The TransformerConfig keyword arguments among these."""
        return {
            "bias_activation_fusion": self.bias_activation_fusion,
            "masked_softmax_fusion": self.masked_softmax_fusion,
            "bias_dropout_fusion": self.bias_dropout_fusion,
            "apply_rope_fusion": self.apply_rope_fusion,
            "gradient_accumulation_fusion": self.gradient_accumulation_fusion,
        }


def kernel_options(impl: str, target: Target) -> KernelOptions:
    """What a model of ``impl`` (resolved: local | transformer_engine) gets on ``target``. The
    fused kernels are CUDA-only; TE's rope fusion, the weight-gradient fusion and the overlapped
    grad reduction come with TE layers."""
    te = target.cuda and impl == "transformer_engine"
    return KernelOptions(
        bias_activation_fusion=target.cuda,
        masked_softmax_fusion=target.cuda,
        bias_dropout_fusion=target.cuda,
        apply_rope_fusion=te,
        gradient_accumulation_fusion=te and target.wgrad_fusion_kernel,
        overlap_grad_reduce=te,
        moe_grouped_gemm=te,
    )


def grad_reduce_overlap(impl: str, cuda: bool) -> bool:
    """Whether megatron DDP overlaps the DP grad reduction with the backward pass (it needs CUDA
    streams)."""
    return kernel_options(impl, Target(cuda=cuda)).overlap_grad_reduce


def run_kernel_options(model: ModelConfig, actor: ActorConfig, target: Target) -> KernelOptions:
    return kernel_options(
        transformer_impl(model.transformer_impl, target, lora=actor.lora.rank > 0), target
    )


def launch_env(
    model: ModelConfig, parallel: ParallelConfig, actor: ActorConfig, target: Target
) -> dict[str, str]:
    """Environment every rank starts with (before CUDA initialises), beyond the caller's own."""
    if not target.cuda:
        return {}
    overlap = run_kernel_options(model, actor, target).overlap_grad_reduce
    if parallel.tp > 1 or overlap:
        # megatron issues its TP and grad-reduce collectives expecting them to run in launch
        # order beside the compute kernels; one hardware queue per device guarantees that.
        return {MAX_CONNECTIONS: "1"}
    return {}


def default_nproc_per_node(parallel: ParallelConfig, rollout: RolloutConfig, target: Target) -> int:
    """Processes ``megarl train`` starts on this node: one per local GPU on CUDA (DP follows from
    the world size; in rollout.placement.mode=async ``parallel.rollout_ranks`` of them roll out), on CPU
    ``tp * pp`` (one data-parallel rank) and the rollout group's ``parallel.rollout_ranks``."""
    if target.cuda and target.local_gpus > 0:
        return target.local_gpus
    return job_world_size(parallel, rollout)


def check_for_target(model: ModelConfig, actor: ActorConfig, target: Target) -> None:
    """Refuse, naming the fix, the combinations that cannot run on ``target``."""
    impl = transformer_impl(model.transformer_impl, target, lora=actor.lora.rank > 0)
    packs = actor.packing
    if impl == "transformer_engine" and model_dtype(model, target.cuda) == "float32" and packs:
        raise ConfigError(
            "model.dtype=float32 with Transformer Engine layers and actor.packing=true cannot run: "
            "Transformer Engine has no attention kernel for packed (THD) batches in fp32 (its "
            "fused and flash backends need bf16/fp16 inputs, its unfused one refuses THD). Set "
            "model.dtype=bfloat16 (or leave model.dtype unset: bf16 on CUDA), or "
            "actor.packing=false, or model.transformer_impl=local"
        )
    if target.cuda and actor.optimizer_offload > 0 and not target.transformer_engine:
        raise ConfigError(
            f"actor.optimizer_offload={actor.optimizer_offload} needs Transformer Engine: "
            "megarl offloads through megatron's precision-aware optimizer, which moves the fp32 "
            "main weights to the host with Adam's moments (without it megatron keeps them on "
            "the GPU: 8 of the 12 bytes per parameter freed, measured on an H200), and "
            "megatron-core 0.16.1 checks that option against Transformer Engine's version. "
            "Install Transformer Engine (bash scripts/setup.sh without MEGARL_NO_TE) or set "
            "actor.optimizer_offload=0"
        )


__all__ = [
    "MAX_CONNECTIONS",
    "KernelOptions",
    "Target",
    "check_for_target",
    "default_nproc_per_node",
    "grad_reduce_overlap",
    "kernel_options",
    "launch_env",
    "run_kernel_options",
    "transformer_impl",
]
