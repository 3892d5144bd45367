"""megarl's rope (megarl.models.rotary) and in-place clipping scale (megarl.models.grad_scale)
against megatron-core's own functions: outputs and gradients bitwise equal (fp32)."""

from __future__ import annotations

import pytest
import torch

from megarl.models import rotary
from megarl.models.grad_scale import scale_in_place

pytestmark = pytest.mark.unit


def _megatron_bshd():
    rotary.use_cached_rotary()
    return rotary._megatron_bshd


def _rope_and_grads(fn, t, freqs, **kwargs):
    t = t.clone().requires_grad_(True)
    out = fn(t, freqs, **kwargs)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), t.grad


def test_rope_equals_megatron_bitwise_and_reuses_cos_sin():
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(7, 2, 3, 16, generator=gen)  # [s, b, heads, head_dim]
    freqs = torch.randn(7, 1, 1, 16, generator=gen)
    reference = _megatron_bshd()
    for mscale in (1.0, 0.7):
        want = _rope_and_grads(reference, t, freqs, mscale=mscale)
        got = _rope_and_grads(rotary.apply_rotary_bshd, t, freqs, mscale=mscale)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # The second call with the same frequencies reuses them; an in-place change recomputes.
    first = rotary._cos_sin(freqs, 1.0, torch.float32)
    assert rotary._cos_sin(freqs, 1.0, torch.float32) is first
    freqs.mul_(2.0)
    want = _rope_and_grads(reference, t, freqs)
    got = _rope_and_grads(rotary.apply_rotary_bshd, t, freqs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    "case", ["interleaved", "partial"], ids=["interleaved rope", "rope over part of the head"]
)
def test_rope_variants_it_does_not_handle_go_to_megatron(case):
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(5, 1, 2, 16, generator=gen)
    freqs = torch.randn(5, 1, 1, 8 if case == "partial" else 16, generator=gen)
    kwargs = {"rotary_interleaved": case == "interleaved"}
    want = _rope_and_grads(_megatron_bshd(), t, freqs, **kwargs)
    got = _rope_and_grads(rotary.apply_rotary_bshd, t, freqs, **kwargs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_packed_rope_goes_through_it_and_equals_megatron():
    """THD packs: megatron's ``apply_rotary_pos_emb`` with ``cu_seqlens`` calls the bshd function."""
    from megatron.core.models.common.embeddings import rope_utils

    gen = torch.Generator().manual_seed(2)
    t = torch.randn(9, 2, 16, generator=gen)  # [tokens, heads, head_dim], sequences 4 + 5
    freqs = torch.randn(9, 1, 1, 16, generator=gen)
    cu = torch.tensor([0, 4, 9])

    class Config:
        apply_rope_fusion = False
        rotary_interleaved = False
        multi_latent_attention = False

    class OneRank:
        def size(self):
            return 1

        def rank(self):
            return 0

    def packed(t, freqs):
        return rope_utils.apply_rotary_pos_emb(
            t, freqs, config=Config(), cu_seqlens=cu, cp_group=OneRank()
        )

    reference = _megatron_bshd()
    got = _rope_and_grads(packed, t, freqs)
    assert rope_utils._apply_rotary_pos_emb_bshd is rotary.apply_rotary_bshd
    rope_utils._apply_rotary_pos_emb_bshd = reference
    try:
        want = _rope_and_grads(packed, t, freqs)
    finally:
        rope_utils._apply_rotary_pos_emb_bshd = rotary.apply_rotary_bshd
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_in_place_scale_equals_megatron_copying_scale():
    from megatron.core.utils import local_multi_tensor_scale

    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=gen) for n in (5, 1000, 33)]
    mine, theirs = [g.clone() for g in grads], [g.clone() for g in grads]
    scale_in_place(0, torch.zeros(1), [mine, mine], 0.123)
    local_multi_tensor_scale(0, torch.zeros(1), [theirs, theirs], 0.123)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert not torch.equal(mine[1], grads[1])  # it did scale
    # distinct source and destination lists: dst = src * scale, src untouched
    dst = [torch.zeros_like(g) for g in grads]
    scale_in_place(0, torch.zeros(1), [grads, dst], 2.0)
    assert all(torch.equal(d, g * 2.0) for d, g in zip(dst, grads, strict=True))


def test_megatron_paths_for_comparisons_are_restored():
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_scale

    from megarl.models.grad_scale import megatron_grad_scaling, use_in_place_grad_scaling

    rotary.use_cached_rotary()
    assert use_in_place_grad_scaling()
    with rotary.megatron_rotary(), megatron_grad_scaling():
        assert rope_utils._apply_rotary_pos_emb_bshd is rotary._megatron_bshd
        assert clip_grads.multi_tensor_scale_impl is local_multi_tensor_scale
    assert rope_utils._apply_rotary_pos_emb_bshd is rotary.apply_rotary_bshd
    assert clip_grads.multi_tensor_scale_impl is scale_in_place
