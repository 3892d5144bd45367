"""What pinned host memory really takes: torch's caching host allocator (the one behind
``torch.empty(..., pin_memory=True)`` and ``tensor.pin_memory()`` on CUDA) rounds every block up
to the next power of two, and keeps freed blocks pinned for reuse.

Read in PyTorch's CachingHostAllocator; measured on an H200 (torch 2.11, ``scripts/gpu_check.sh``
section 6): 1.5 GiB asked took 2 GiB, 3 GiB took 4 GiB. A host copy made of many tensors (one
block each: Adam's moments of each parameter, vLLM's weights, megatron's hybrid optimizer's
grads) takes the sum of their rounded sizes: :func:`pinned_ratio` of its tensors' sizes.
"""

from __future__ import annotations

from collections.abc import Iterable


def pinned_bytes(nbytes: int) -> int:
    """The pinned bytes one block of ``nbytes`` takes (0 for nothing)."""
    if nbytes <= 0:
        return 0
    return 1 << (int(nbytes) - 1).bit_length()


def pinned_ratio(sizes: Iterable[int]) -> float:
    """Pinned bytes over requested bytes for one block per size in ``sizes`` (1.0: none)."""
    sizes = [s for s in sizes if s > 0]
    total = sum(sizes)
    return sum(pinned_bytes(s) for s in sizes) / total if total else 1.0


def pinned_share(nbytes: int, sizes: Iterable[int]) -> int:
    """``nbytes`` of host copies made of blocks distributed like ``sizes`` (their share of a
    set of tensors), as pinned memory takes them."""
    return int(nbytes * pinned_ratio(sizes))


__all__ = ["pinned_bytes", "pinned_ratio", "pinned_share"]
