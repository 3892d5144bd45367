"""Value loss and entropy terms against loops (float64, 1e-12)."""

from __future__ import annotations

import pytest
import torch

from megarl.algos import (
    compute_entropy_loss,
    compute_value_loss,
    entropy_bonus,
)
from tests.unit.test_algos_refs import ragged_mask, ref_agg, valid_positions

TOL = 1e-12


def _value_inputs(seed: int, batch: int = 6, length: int = 5):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    new = old + 0.5 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    ret = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return new, old, ret, ragged_mask(gen, batch, length)


@pytest.mark.parametrize("clip", [0.2, None])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_value_loss_value_grad_and_clipfrac_equal_loop(clip, mode):
    new, old, ret, mask = _value_inputs(0)
    new.requires_grad_()
    loss, m = compute_value_loss(new, old, ret, mask, cliprange_value=clip, loss_agg_mode=mode)
    (grad,) = torch.autograd.grad(loss, new)

    new_ref = new.detach().clone().requires_grad_()
    mat, n, n_clipped = [], 0, 0
    for i in range(mask.shape[0]):
        row = []
        for t in range(mask.shape[1]):
            if not bool(mask[i, t]):
                row.append(0.0)
                continue
            v, o, r = new_ref[i, t], float(old[i, t]), float(ret[i, t])
            plain = (v - r) ** 2
            if clip is None:
                row.append(0.5 * plain)
            else:
                vc = o + min(max(v - o, -clip), clip)
                clipped = (vc - r) ** 2
                n_clipped += int(clipped > plain)
                row.append(0.5 * max(plain, clipped))
            n += 1
        mat.append(row)
    ref = ref_agg(mat, mask, mode)
    (grad_ref,) = torch.autograd.grad(ref, new_ref)
    assert abs(loss.item() - ref.item()) < TOL
    assert torch.allclose(grad, grad_ref, atol=TOL, rtol=0)
    assert abs(m["vf_clipfrac"].item() - n_clipped / n) < TOL
    if clip is not None:
        assert n_clipped > 0


def test_value_loss_gradcheck():
    new, old, ret, mask = _value_inputs(1, batch=3, length=4)
    assert torch.autograd.gradcheck(
        lambda v: compute_value_loss(v, old, ret, mask, 0.2)[0], (new.requires_grad_(),)
    )


def test_value_loss_nan_in_returns_at_valid_position_is_an_error():
    new, old, ret, mask = _value_inputs(2)
    ret[tuple(mask.nonzero()[0].tolist())] = float("nan")
    with pytest.raises(ValueError, match="returns"):
        compute_value_loss(new, old, ret, mask, 0.2)


def test_entropy_bonus_is_minus_coef_times_mean_entropy():
    gen = torch.Generator().manual_seed(3)
    mask = ragged_mask(gen, 5, 6)
    ent = torch.rand(5, 6, generator=gen, dtype=torch.float64) * 3
    ent[~mask] = float("nan")  # padding is ignored
    term, m = entropy_bonus(ent, mask, entropy_coef=0.01)
    vals = [float(ent[i, t]) for i in range(5) for t in valid_positions(mask, i)]
    h = sum(vals) / len(vals)
    assert abs(m["entropy"].item() - h) < TOL
    assert abs(term.item() + 0.01 * h) < TOL
    assert abs(compute_entropy_loss(ent, mask).item() - h) < TOL


def test_explained_variance_against_numpy():
    import numpy as np

    from megarl.algos import explained_variance

    gen = torch.Generator().manual_seed(0)
    returns = torch.randn(4, 6, generator=gen)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    values = returns + 0.5 * torch.randn(4, 6, generator=gen)
    valid = mask.bool().numpy()
    r, v = returns.numpy()[valid], values.numpy()[valid]
    expected = 1 - np.var(r - v, ddof=1) / np.var(r, ddof=1)
    assert float(explained_variance(values, returns, mask)) == pytest.approx(expected, rel=1e-5)
    assert float(explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    zeros = torch.zeros_like(returns)  # a fresh critic head: no better than a constant
    assert float(explained_variance(zeros, returns, mask)) < 0.1


def test_explained_variance_of_summed_rank_sums_is_the_whole_batch():
    """Two data-parallel ranks' sums add up to the whole batch's explained variance (what the
    trainer logs), which a mean of the two ranks' own ratios is not."""
    import numpy as np

    from megarl.algos import (
        explained_variance,
        explained_variance_from_sums,
        explained_variance_sums,
    )

    gen = torch.Generator().manual_seed(1)
    returns = torch.randn(6, 5, generator=gen)
    returns[3:] += 2.0  # the second rank's returns sit elsewhere
    values = returns + 0.7 * torch.randn(6, 5, generator=gen)
    mask = torch.ones(6, 5)
    mask[2, 3:] = 0
    whole = float(explained_variance(values, returns, mask))
    valid = mask.bool().numpy()
    r, v = returns.numpy()[valid], values.numpy()[valid]
    assert whole == pytest.approx(1 - np.var(r - v, ddof=1) / np.var(r, ddof=1), rel=1e-5)
    halves = [slice(0, 3), slice(3, 6)]
    sums = sum(explained_variance_sums(values[h], returns[h], mask[h]) for h in halves)
    assert explained_variance_from_sums(sums) == pytest.approx(whole, rel=1e-4)
    per_rank = [
        explained_variance_from_sums(explained_variance_sums(values[h], returns[h], mask[h]))
        for h in halves
    ]
    assert abs(sum(per_rank) / 2 - whole) > 0.05  # why the sums, not the ratios, are reduced
    zeros = torch.zeros_like(returns)  # a fresh zero head: exactly 0
    assert explained_variance_from_sums(explained_variance_sums(zeros, returns, mask)) == 0.0
    flat = torch.ones_like(returns)  # returns that do not vary: undefined
    assert np.isnan(explained_variance_from_sums(explained_variance_sums(values, flat, mask)))
