"""Move a trained model's memory (weights, grad buffers, optimizer states) to the host and back.

For the colocated rollout phase: the trainer's tensors leave the accelerator before the rollout
engine wakes and come back after it sleeps. What moves is *storage*: each distinct storage is
copied whole to a host buffer and then shrunk to zero bytes in place. Tensors keep their identity,
shapes and views (megatron's parameters are views into its DDP param buffer, Adam's states live in
the optimizer), so nothing that holds a reference needs to learn about the move; restoring grows
each storage back and copies the bytes in, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


@dataclass
class Offloaded:
    """Host copies of storages released on their device; :func:`onload` restores them."""

    storages: list[torch.UntypedStorage] = field(default_factory=list)
    host: list[torch.Tensor] = field(default_factory=list)
    bytes_moved: int = 0
    seconds: float = 0.0


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def model_tensors(model: torch.nn.Module, optimizer=None) -> list[torch.Tensor]:
    """The tensors of a (possibly DDP-wrapped) model and its optimizer that hold memory: parameters,
    their grads (``main_grad`` under megatron DDP), buffers, and every tensor in the optimizer
    state (also inside megatron's wrappers, reached through ``.optimizer``)."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(p)
        for grad in (p.grad, getattr(p, "main_grad", None)):
            if grad is not None:
                out.append(grad)
    # Module.buffers explicitly: megatron's DDP names its list of grad buffers ``buffers``
    # (the parameters and main grads above are views into those).
    out.extend(torch.nn.Module.buffers(model))
    for holder in _optimizers(optimizer):
        for group in holder.param_groups:  # megatron's fp32 main params / shards
            out.extend(group["params"])
        for side in device_side(holder):
            for group in side.param_groups:
                out.extend(group["params"])
            for state in side.state.values():
                out.extend(v for v in state.values() if torch.is_tensor(v))
    return out


def device_side(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers whose state lives on the device with the parameters: ``optimizer`` itself,
    or of megatron's hybrid CPU/GPU optimizer (``actor.optimizer_offload``) only its GPU side.

    The hybrid optimizer's CPU side is torch's Adam stepping its own host tensors in place (copies
    of the parameters, their moments and master weights, pinned): they are on the host by design,
    and moving them (to the GPU, or out of their storage) breaks it.
    """
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    if not isinstance(optimizer, HybridDeviceOptimizer):
        return [optimizer]
    return [optimizer.gpu_optimizer] if optimizer.gpu_optimizer is not None else []


def optimizer_moments(optimizer) -> list[torch.Tensor]:
    """The optimizer state that may leave the device while the rollout runs (Adam's moments): the
    per-parameter state tensors of the device-side optimizers (:func:`device_side`) that live on
    their parameter's device, are not scalars (step counts) and are not parameters themselves
    (the hybrid optimizer keeps master weights as the state ``master_param``; weights the
    reshard reads share storage with megatron's main parameters)."""
    out: list[torch.Tensor] = []
    for holder in _optimizers(optimizer):
        for side in device_side(holder):
            params = {
                p.untyped_storage().data_ptr() for g in side.param_groups for p in g["params"]
            }
            for param, state in side.state.items():
                out.extend(
                    v
                    for v in state.values()
                    if torch.is_tensor(v)
                    and v.dim() > 0
                    and v.device == param.device
                    and v.untyped_storage().data_ptr() not in params
                )
    return out


def _optimizers(optimizer) -> Iterable[torch.optim.Optimizer]:
    seen = set()
    stack = [optimizer] if optimizer is not None else []
    while stack:
        opt = stack.pop()
        if id(opt) in seen:
            continue
        seen.add(id(opt))
        if isinstance(opt, torch.optim.Optimizer):
            yield opt
        chained = getattr(opt, "chained_optimizers", None)
        if chained is not None:
            # megatron's ChainedOptimizer (e.g. dense and MoE expert parameters apart) refuses
            # ``.optimizer`` when it chains more than one
            stack.extend(chained)
            continue
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            stack.append(inner)


def offload(tensors: Iterable[torch.Tensor]) -> Offloaded:
    """Copy each distinct non-empty storage of ``tensors`` to the host and release it in place."""
    start = time.perf_counter()
    result = Offloaded()
    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        device = t.device
        host = torch.empty(
            storage.nbytes(),
            dtype=torch.uint8,
            device="cpu",
            pin_memory=device.type == "cuda",
        )
        host.copy_(_bytes_of(storage, device), non_blocking=device.type == "cuda")
        result.storages.append(storage)
        result.host.append(host)
        result.bytes_moved += storage.nbytes()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for storage in result.storages:
        storage.resize_(0)
    result.seconds = time.perf_counter() - start
    return result


def onload(offloaded: Offloaded) -> float:
    """Grow each released storage back and copy its bytes in; returns the seconds taken."""
    start = time.perf_counter()
    for storage, host in zip(offloaded.storages, offloaded.host, strict=True):
        storage.resize_(host.numel())
        _bytes_of(storage, storage.device).copy_(host, non_blocking=host.is_pinned())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    offloaded.storages.clear()
    offloaded.host.clear()
    return time.perf_counter() - start
