"""Which optional engines a run uses on this machine, decided (and refused) before launch.

- ``model.transformer_impl``: ``transformer_engine`` layers need CUDA and Transformer Engine;
  ``local`` is megatron's own spec (any device); ``auto`` takes TE where both are present.
- ``rollout.engine.backend``: ``vllm`` needs vLLM installed (``megarl[cpu]`` or ``megarl[gpu]``); ``hf``
  generates with Hugging Face transformers (no extra package).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from megarl.config import ActorConfig, ModelConfig, ParallelConfig, choices
from megarl.errors import ConfigError
from megarl.gpu_defaults import Target, check_for_target, launch_env, transformer_impl

TRANSFORMER_IMPLS = choices("model.transformer_impl")


def installed(package: str) -> bool:
    """Whether ``package`` can be imported here (without importing it)."""
    return importlib.util.find_spec(package) is not None


def this_machine() -> Target:
    """This machine as :mod:`megarl.gpu_defaults` decides for it."""
    cuda = torch.cuda.is_available()
    return Target(
        cuda=cuda,
        transformer_engine=installed("transformer_engine"),
        wgrad_fusion_kernel=installed("fused_weight_gradient_mlp_cuda"),
        local_gpus=torch.cuda.device_count() if cuda else 0,
    )


def resolve_transformer_impl(requested: str) -> str:
    """``local`` or ``transformer_engine`` for ``model.transformer_impl`` on this machine; raises
    when TE is requested where it cannot run."""
    if requested not in TRANSFORMER_IMPLS:
        raise ConfigError(
            f"model.transformer_impl={requested!r} is not one of {list(TRANSFORMER_IMPLS)}"
        )
    return transformer_impl(requested, this_machine())


def check_rollout_backend(backend: str) -> None:
    backends = choices(
        "rollout.engine.backend"
    )  # megarl.rollout.engine.ROLLOUT_BACKENDS builds them
    if backend not in backends:
        raise ConfigError(f"rollout.engine.backend={backend!r} is not one of {list(backends)}")
    if backend == "vllm" and not installed("vllm"):
        raise ConfigError(
            "rollout.engine.backend=vllm, but vLLM is not installed; install megarl[gpu] (CUDA) or "
            "megarl[cpu] (CPU), or set rollout.engine.backend=hf to generate with transformers"
        )


def check_context_parallel(cp: int, transformer_impl: str) -> None:
    """``parallel.cp > 1`` is refused before launch: without Transformer Engine (CPU) there is no
    context-parallel attention; with it, megarl does not build context parallelism yet."""
    if cp == 1:
        return
    if resolve_transformer_impl(transformer_impl) != "transformer_engine":
        raise ConfigError(
            f"parallel.cp={cp}: context parallelism needs Transformer Engine (its attention "
            "exchanges key/value chunks between ranks), which needs CUDA and megarl[gpu]; "
            "this run uses megatron's local spec. Set parallel.cp=1; for long sequences use "
            "parallel.tp > 1 (sequence parallelism is on by default there) and "
            "model.recompute=selective or full"
        )
    raise ConfigError(
        f"parallel.cp={cp}: megarl does not build context-parallel models yet; set "
        "parallel.cp=1 and use parallel.tp > 1 (with sequence parallelism) and "
        "model.recompute for long sequences"
    )


def check_optimizer_offload(fraction: float) -> None:
    """megatron's optimizer CPU offload (HybridDeviceOptimizer) moves states from the GPU to the
    host; on a CPU-only machine they are on the host already, and megatron-core 0.16's offload
    asks for CUDA streams at construction."""
    if fraction > 0 and not torch.cuda.is_available():
        raise ConfigError(
            f"actor.optimizer_offload={fraction}: optimizer offload moves optimizer states from "
            "GPU to host memory and needs CUDA; on CPU the states are in host memory already: "
            "set actor.optimizer_offload=0"
        )


def check_backends(
    model: ModelConfig,
    actor: ActorConfig,
    parallel: ParallelConfig,
    rollout_backend: str | None,
) -> None:
    """Every engine these sections ask for can run here; before any process starts.
    ``rollout_backend``: ``rollout.engine.backend`` of a run that rolls out (None: a trainer without a
    rollout engine, SFT, DPO, a reward model)."""
    resolve_transformer_impl(model.transformer_impl)
    check_for_target(model, actor, this_machine())  # combinations this machine cannot run
    check_context_parallel(parallel.cp, model.transformer_impl)
    check_optimizer_offload(actor.optimizer_offload)
    if rollout_backend is not None:
        check_rollout_backend(rollout_backend)


def rollout_backend(trainer_kind: str, backend: str) -> str | None:
    """``rollout.engine.backend`` where ``trainer.kind`` rolls out (a policy run), else None (SFT, DPO,
    a reward model build no rollout engine): what :func:`check_backends` checks."""
    return backend if trainer_kind == "policy" else None


def set_rank_env(
    model: ModelConfig, parallel: ParallelConfig, actor: ActorConfig
) -> dict[str, str]:
    """Put what every rank needs in its environment before CUDA initialises
    (:func:`megarl.gpu_defaults.launch_env`); a value already set is kept. Returns what was set."""
    added = {
        k: v
        for k, v in launch_env(model, parallel, actor, this_machine()).items()
        if k not in os.environ
    }
    os.environ.update(added)
    return added
