"""Scale gradients in place when megatron clips them, instead of megatron's fallback copy.

Without apex or Transformer Engine (always on CPU, and on GPUs without either), megatron-core
scales the gradients for clipping with ``megatron.core.utils.local_multi_tensor_scale``:
``dst.copy_(src * scale)`` for every gradient, with ``src`` and ``dst`` the same tensors. That
allocates a temporary the size of each gradient and writes the whole fp32 grad buffer twice (on
SmolLM2-135M, 540 MB of grads each clipped step). :func:`scale_in_place` computes the same
products (one fp32 multiply per element, so the result is bitwise equal) with
``torch._foreach_mul_`` and no temporaries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def scale_in_place(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], scale: float
) -> None:
    """Drop-in for ``amp_C.multi_tensor_scale`` / megatron's local version: ``dst = src * scale``.

    Lists whose source and destination are the same tensors (megatron's grad clipping) are scaled
    in place; any other pair is computed as megatron does.
    """
    sources, targets = tensor_lists[0], tensor_lists[1]
    in_place = [d for s, d in zip(sources, targets, strict=True) if s is d]
    if in_place:
        torch._foreach_mul_(in_place, scale)
    for src, dst in zip(sources, targets, strict=True):
        if src is not dst:
            dst.copy_(src * scale)


def use_in_place_grad_scaling() -> bool:
    """Make megatron's grad clipping scale in place when it would use its copying fallback;
    returns whether it does (False when apex's or Transformer Engine's fused kernel is in use)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.multi_tensor_scale_impl is scale_in_place:
        return True
    if clip_grads.multi_tensor_scale_impl is not utils.local_multi_tensor_scale:
        return False
    clip_grads.multi_tensor_scale_impl = scale_in_place
    return True


@contextlib.contextmanager
def megatron_grad_scaling() -> Iterator[None]:
    """megatron's copying ``local_multi_tensor_scale`` inside the block (for comparisons)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    previous = clip_grads.multi_tensor_scale_impl
    clip_grads.multi_tensor_scale_impl = utils.local_multi_tensor_scale
    try:
        yield
    finally:
        clip_grads.multi_tensor_scale_impl = previous
