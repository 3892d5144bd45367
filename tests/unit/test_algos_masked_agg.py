"""Masked reductions, whitening and loss aggregation against loop references (float64, 1e-12)."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algos import agg_loss, masked_mean, masked_var, masked_whiten
from megarl.algos.masked import masked_sum
from tests.unit.test_algos_refs import ragged_mask, ref_agg, ref_whiten, valid_positions

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
TOL = 1e-12


def _data(seed: int, batch: int = 7, length: int = 6):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, length, generator=gen, dtype=torch.float64),
        ragged_mask(gen, batch, length),
    )


def test_masked_mean_and_var_equal_loops():
    x, mask = _data(0)
    vals = [float(x[i, t]) for i in range(x.shape[0]) for t in valid_positions(mask, i)]
    mean = sum(vals) / len(vals)
    assert abs(masked_mean(x, mask).item() - mean) < TOL
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    assert abs(masked_var(x, mask).item() - var) < TOL
    row_means = masked_mean(x, mask, dim=-1)
    for i in range(x.shape[0]):
        pos = valid_positions(mask, i)
        expected = sum(float(x[i, t]) for t in pos) / len(pos) if pos else 0.0
        assert abs(row_means[i].item() - expected) < TOL


def test_masked_mean_accepts_float_and_int_masks():
    x, mask = _data(1)
    ref = masked_mean(x, mask)
    assert masked_mean(x, mask.double()).item() == ref.item()
    assert masked_mean(x, mask.int()).item() == ref.item()


def test_masked_whiten_equals_loop_and_zeroes_padding():
    x, mask = _data(2)
    out = masked_whiten(x, mask)
    ref = ref_whiten(x.tolist(), mask)
    assert torch.allclose(out, torch.tensor(ref, dtype=torch.float64), atol=TOL, rtol=0)
    shifted = masked_whiten(x, mask, shift_mean=False)
    mean = masked_mean(x, mask)
    assert torch.allclose(shifted[mask], out[mask] + mean, atol=TOL, rtol=0)


@pytest.mark.parametrize("n_valid", [0, 1])
def test_masked_whiten_with_fewer_than_two_values_is_an_error(n_valid):
    x = torch.randn(2, 3, dtype=torch.float64)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    mask[0, :n_valid] = True
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(x, mask)


def test_masked_mean_of_nothing_is_zero_with_zero_grad():
    x = torch.full((2, 3), float("nan"), dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    out = masked_mean(x, mask)
    (g,) = torch.autograd.grad(out, x)
    assert out.item() == 0.0 and bool((g == 0).all())


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_equals_loop_reference(mode):
    x, mask = _data(3)
    assert abs(agg_loss(x, mask, mode).item() - ref_agg(x.tolist(), mask, mode)) < TOL


def test_seq_mean_token_sum_norm_uses_the_constant():
    x, mask = _data(4)
    got = agg_loss(x, mask, "seq-mean-token-sum-norm", norm_length=100)
    assert abs(got.item() - ref_agg(x.tolist(), mask, "seq-mean-token-sum-norm", 100)) < TOL


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_gradcheck(mode):
    x, mask = _data(5, batch=3, length=4)
    assert torch.autograd.gradcheck(lambda t: agg_loss(t, mask, mode), (x.requires_grad_(),))


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_global_denominators_sum_to_the_whole_batch(mode):
    x, mask = _data(6, batch=8)
    whole = agg_loss(x, mask, mode)
    kw = (
        {"num_tokens": int(mask.sum())}
        if mode == "token-mean"
        else {"num_seqs": int(mask.any(-1).sum())}
    )
    parts = sum(agg_loss(x[s], mask[s], mode, **kw) for s in (slice(0, 3), slice(3, 8)))
    assert abs(parts.item() - whole.item()) < TOL


def test_all_masked_aggregation_is_zero_not_nan():
    x = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.zeros(3, 4)
    for mode in MODES:
        assert agg_loss(x, mask, mode).item() == 0.0


def test_agg_loss_unknown_option_is_a_type_error():
    x, mask = _data(7)
    with pytest.raises(TypeError, match="num_seqs"):
        agg_loss(x, mask, "token-mean", num_seqs=3)


def test_seq_mean_ignores_sequences_without_valid_tokens():
    x = torch.tensor([[1.0, 2.0], [5.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [0, 0]])
    assert agg_loss(x, mask, "seq-mean-token-sum").item() == 3.0
    assert agg_loss(x, mask, "seq-mean-token-mean").item() == 1.5
    assert math.isclose(agg_loss(x, mask, "seq-mean-token-sum-norm").item(), 1.5)


def test_whitening_two_halves_with_the_other_halfs_sums_equals_whitening_the_whole():
    """A batch split over two data-parallel ranks: each half whitened with ``batch_sum`` adding
    the other half's sums gives the whole batch's whitening (the trainer passes an all-reduce;
    here the other half's statistic is computed by hand)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=gen) * 3 + 1
    mask = torch.rand(6, 5, generator=gen) > 0.3
    whole = masked_whiten(x, mask)
    halves = [(x[:3], mask[:3], x[3:], mask[3:]), (x[3:], mask[3:], x[:3], mask[:3])]
    out = []
    for mine, my_mask, other, other_mask in halves:
        calls = iter([0, 1])

        def batch_sum(t, other=other, other_mask=other_mask, calls=calls):
            if next(calls) == 0:  # the sum and count
                return t + torch.stack([masked_sum(other, other_mask), other_mask.sum().float()])
            mean = (masked_sum(x, mask) / mask.sum()).item()  # the second pass: squared deviations
            return t + masked_sum((other - mean) ** 2, other_mask)

        out.append(masked_whiten(mine, my_mask, batch_sum=batch_sum))
    torch.testing.assert_close(torch.cat(out), whole, rtol=1e-5, atol=1e-6)
    # the local whitening of a half differs: the bug a DP layout had before batch_sum
    assert not torch.allclose(masked_whiten(x[:3], mask[:3]), whole[:3], atol=1e-3)
