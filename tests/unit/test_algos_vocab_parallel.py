"""Log-prob / entropy kernels on one process (group=None) against a per-row loop reference.

The multi-rank (TP2, TP4) checks are in tests/distributed/test_vocab_parallel.py. Tolerances:
float64 1e-12; float32 inputs vs a float64 reference 2e-5 (fp32 rounding over ~100 terms);
bf16 inputs vs a float64 reference of the same bf16 values 1e-5 (accumulation is fp32).
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algos import (
    entropy_from_logits,
    log_probs_from_logits,
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)


def ref_logprob_entropy(logits: torch.Tensor, ids: torch.Tensor, vocab: int | None = None):
    """Per row: log-sum-exp by hand with Python floats; only the first ``vocab`` columns count."""
    rows = logits.detach().double().reshape(-1, logits.shape[-1]).tolist()
    flat_ids = ids.reshape(-1).tolist()
    lps, ents = [], []
    for row, y in zip(rows, flat_ids, strict=True):
        row = [v for v in row[: vocab or len(row)]]
        finite = [v for v in row if v != float("-inf")]
        mx = max(finite)
        lse = mx + math.log(sum(math.exp(v - mx) for v in finite))
        lps.append(row[y] - lse)
        ents.append(-sum(math.exp(v - lse) * (v - lse) for v in finite))
    shape = ids.shape
    return (
        torch.tensor(lps, dtype=torch.float64).reshape(shape),
        torch.tensor(ents, dtype=torch.float64).reshape(shape),
    )


def _logits(seed: int, shape=(3, 4, 37), dtype=torch.float64, scale: float = 3.0):
    gen = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(*shape, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    return z.to(dtype), ids


@pytest.mark.parametrize("chunk_elems", [1, 40, 1 << 25])
def test_values_equal_loop_reference_for_any_chunking(chunk_elems):
    z, ids = _logits(0)
    lp, h = vocab_parallel_log_probs_and_entropy(z, ids, None, chunk_elems=chunk_elems)
    rlp, rh = ref_logprob_entropy(z, ids)
    assert torch.allclose(lp, rlp, atol=1e-12, rtol=0)
    assert torch.allclose(h, rh, atol=1e-12, rtol=0)
    assert torch.equal(log_probs_from_logits(z, ids), vocab_parallel_log_probs(z, ids, None))
    assert torch.equal(entropy_from_logits(z), vocab_parallel_entropy(z, None))
    assert torch.allclose(entropy_from_logits(z), rh, atol=1e-12, rtol=0)


def test_gradients_equal_autograd_through_log_softmax():
    z, ids = _logits(1)
    gen = torch.Generator().manual_seed(2)
    w1 = torch.randn(ids.shape, generator=gen, dtype=torch.float64)
    w2 = torch.randn(ids.shape, generator=gen, dtype=torch.float64)
    za = z.clone().requires_grad_()
    lp, h = vocab_parallel_log_probs_and_entropy(za, ids, None, chunk_elems=50)
    (g,) = torch.autograd.grad((w1 * lp).sum() + (w2 * h).sum(), za)
    zb = z.clone().requires_grad_()
    logp = torch.log_softmax(zb, dim=-1)
    ref = (w1 * logp.gather(-1, ids[..., None])[..., 0]).sum() - (
        w2 * (logp.exp() * logp).sum(-1)
    ).sum()
    (g_ref,) = torch.autograd.grad(ref, zb)
    assert torch.allclose(g, g_ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("which", ["both", "logprob", "entropy"])
def test_gradcheck(which):
    z, ids = _logits(3, shape=(2, 3, 7))

    def f(x):
        if which == "logprob":
            return vocab_parallel_log_probs(x, ids, None, chunk_elems=8)
        if which == "entropy":
            return vocab_parallel_entropy(x, None, chunk_elems=8)
        return vocab_parallel_log_probs_and_entropy(x, ids, None, chunk_elems=8)

    assert torch.autograd.gradcheck(f, (z.requires_grad_(),))


def test_padded_vocab_columns_are_ignored_and_get_zero_grad():
    z, ids = _logits(4, shape=(2, 3, 16))
    ids = ids % 11
    za = z.clone().requires_grad_()
    lp, h = vocab_parallel_log_probs_and_entropy(za, ids, None, vocab_size=11)
    rlp, rh = ref_logprob_entropy(z, ids, vocab=11)
    assert torch.allclose(lp, rlp, atol=1e-12, rtol=0) and torch.allclose(h, rh, atol=1e-12, rtol=0)
    (g,) = torch.autograd.grad(lp.sum() + h.sum(), za)
    assert bool((g[..., 11:] == 0).all()) and bool((g[..., :11] != 0).any())


def test_minus_inf_logits_give_finite_entropy_and_grads():
    z, ids = _logits(5, shape=(4, 12))
    z[:, 5:9] = float("-inf")  # e.g. a vocabulary mask
    ids = ids % 5
    za = z.clone().requires_grad_()
    lp, h = vocab_parallel_log_probs_and_entropy(za, ids, None)
    rlp, rh = ref_logprob_entropy(z, ids)
    assert torch.allclose(lp, rlp, atol=1e-12, rtol=0) and torch.allclose(h, rh, atol=1e-12, rtol=0)
    (g,) = torch.autograd.grad(lp.sum() + h.sum(), za)
    assert bool(torch.isfinite(g).all()) and bool((g[:, 5:9] == 0).all())


def test_float32_and_bfloat16_accumulate_in_float32():
    z64, ids = _logits(6, shape=(4, 8, 101))
    lp, h = vocab_parallel_log_probs_and_entropy(z64.float(), ids, None)
    rlp, rh = ref_logprob_entropy(z64.float(), ids)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp.double(), rlp, atol=2e-5, rtol=0)
    assert torch.allclose(h.double(), rh, atol=2e-5, rtol=0)
    zb = z64.bfloat16().requires_grad_()
    lp, h = vocab_parallel_log_probs_and_entropy(zb, ids, None)
    rlp, rh = ref_logprob_entropy(zb, ids)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp.double(), rlp, atol=1e-5, rtol=0)
    assert torch.allclose(h.double(), rh, atol=1e-5, rtol=0)
    (g,) = torch.autograd.grad(lp.sum(), zb)
    assert g.dtype == torch.bfloat16


def test_large_logits_do_not_overflow():
    z = torch.tensor([[1e4, 1e4 - 1.0, -1e4]], dtype=torch.float32)
    lp, h = vocab_parallel_log_probs_and_entropy(z, torch.tensor([1]), None)
    expected_lp = -1.0 - math.log(1 + math.exp(-1.0))
    assert abs(lp.item() - expected_lp) < 1e-6 and math.isfinite(h.item())


def test_bad_targets_and_shapes_are_clear_errors():
    z, ids = _logits(7)
    with pytest.raises(ValueError, match=r"target_ids must be in \[0, 37\)"):
        vocab_parallel_log_probs(z, ids + 37, None)
    with pytest.raises(ValueError, match=r"target_ids must be in \[0, 30\)"):
        vocab_parallel_log_probs(z, ids.clamp(max=30), None, vocab_size=30)
    with pytest.raises(ValueError, match="shape"):
        vocab_parallel_log_probs(z, ids[:, :-1], None)
    with pytest.raises(TypeError, match="integer"):
        vocab_parallel_log_probs(z, ids.float(), None)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_entropy(z, None, vocab_size=38)
