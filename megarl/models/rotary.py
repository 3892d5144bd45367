"""Megatron's unfused rotary embedding without its per-call recomputation and closing copy.

Without the fused rope kernels (CPU, or GPUs without Transformer Engine / apex) megatron-core
applies rope with ``rope_utils._apply_rotary_pos_emb_bshd``, which for every query and every key
of every layer recomputes ``cos(freqs)`` and ``sin(freqs)`` of the same frequencies, and ends with
``torch.cat((t, t_pass))`` even when ``t_pass`` is empty (rope over the whole head): a copy of
every query and key tensor, forward, for nothing. :func:`apply_rotary_bshd` computes the same
expression (so its results and gradients are bitwise equal) with the cosines and sines of the
latest frequency tensor kept, and returns the rotated tensor itself when no part passes through.
Interleaved and multi-latent-attention rope, and partial rope, go to megatron's own function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

# The latest (freqs, version, mscale, dtype) and its (cos, sin). GPTModel computes the rotary
# frequencies once per forward and hands the same tensor to the queries and keys of every layer.
_latest: dict[str, object] = {}


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
    key = (freqs._version, mscale, dtype)
    if _latest.get("freqs") is freqs and _latest.get("key") == key:
        return _latest["cos_sin"]
    cos_sin = ((torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype))
    if not freqs.requires_grad:
        _latest.update(freqs=freqs, key=key, cos_sin=cos_sin)
    return cos_sin


def apply_rotary_bshd(
    t: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
) -> torch.Tensor:
    """``rope_utils._apply_rotary_pos_emb_bshd`` for rope over the whole head dimension."""
    if rotary_interleaved or multi_latent_attention or freqs.shape[-1] != t.shape[-1]:
        assert _megatron_bshd is not None, "use_cached_rotary() installs this function"
        return _megatron_bshd(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    cos, sin = _cos_sin(freqs, mscale, t.dtype)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


_megatron_bshd: Callable[..., torch.Tensor] | None = None


def use_cached_rotary() -> None:
    """Route megatron's unfused rope (bshd, and thd through it) to :func:`apply_rotary_bshd`."""
    global _megatron_bshd
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils._apply_rotary_pos_emb_bshd is apply_rotary_bshd:
        return
    _megatron_bshd = rope_utils._apply_rotary_pos_emb_bshd
    rope_utils._apply_rotary_pos_emb_bshd = apply_rotary_bshd


@contextlib.contextmanager
def megatron_rotary() -> Iterator[None]:
    """megatron's own unfused rope inside the block (for comparisons and parity tests)."""
    from megatron.core.models.common.embeddings import rope_utils

    use_cached_rotary()
    rope_utils._apply_rotary_pos_emb_bshd = _megatron_bshd
    try:
        yield
    finally:
        rope_utils._apply_rotary_pos_emb_bshd = apply_rotary_bshd
