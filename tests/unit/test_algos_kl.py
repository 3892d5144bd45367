"""KL estimators, controllers (incl. checkpoint round trip), KL in reward, KL loss (float64)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algos import (
    KL_ESTIMATORS,
    apply_kl_in_reward,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)
from tests.unit.test_algos_refs import ragged_mask, ref_agg, valid_positions

TOL = 1e-12


def _ref_estimator(name: str, lp: float, ref: float) -> float:
    d = lp - ref
    if name == "k1":
        return d
    if name == "abs":
        return abs(d)
    if name == "k2":
        return d * d / 2
    if name == "k3":
        return min(max(math.exp(-d) + d - 1, -10.0), 10.0)
    raise AssertionError(name)


def _pair(seed: int, batch: int = 5, length: int = 6, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 4
    ref = lp + scale * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return lp, ref, ragged_mask(gen, batch, length)


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs"])
def test_estimators_equal_elementwise_formulas(name):
    lp, ref, _ = _pair(0, scale=3.0)  # scale 3 reaches the k3 clamp
    out = kl_penalty(name, lp, ref)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            expected = _ref_estimator(name, float(lp[i, t]), float(ref[i, t]))
            assert abs(out[i, t].item() - expected) < 1e-9 * max(1.0, abs(expected))


def test_k3_clamp_is_reached_by_the_test_data():
    lp, ref, _ = _pair(0, scale=3.0)
    assert float(kl_penalty("k3", lp, ref).max()) == 10.0


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_estimators_gradcheck(name):
    lp, ref, _ = _pair(1, batch=2, length=3, scale=0.5)
    assert torch.autograd.gradcheck(lambda x: kl_penalty(name, x, ref), (lp.requires_grad_(),))


@settings(max_examples=50, deadline=None)
@given(d=st.floats(-30, 30, width=64))
def test_k3_and_k2_and_abs_are_non_negative(d):
    lp = torch.tensor([d], dtype=torch.float64)
    ref = torch.zeros(1, dtype=torch.float64)
    for name in ("k2", "k3", "abs"):
        v = kl_penalty(name, lp, ref).item()
        assert v >= 0.0 and math.isfinite(v)


def test_k2_gradient_is_the_log_ratio():
    lp, ref, _ = _pair(2)
    lp.requires_grad_()
    (g,) = torch.autograd.grad(kl_penalty("k2", lp, ref).sum(), lp)
    assert torch.allclose(g, (lp - ref).detach(), atol=TOL, rtol=0)


def test_unknown_estimator_lists_known():
    lp, ref, _ = _pair(3)
    with pytest.raises(ValueError, match="abs, k1, k2, k3"):
        kl_penalty("low_var_kl", lp, ref)
    assert set(KL_ESTIMATORS.names()) == {"abs", "k1", "k2", "k3"}


# ---------------------------------------------------------------------------------- controllers


def test_fixed_controller_never_moves():
    c = make_kl_controller("fixed", kl_coef=0.05)
    for kl in (0.0, 1.0, 100.0):
        c.update(kl, n_steps=256)
    assert c.value == 0.05


def test_adaptive_controller_follows_ziegler_update():
    c = make_kl_controller("adaptive", kl_coef=0.2, target_kl=6.0, horizon=10_000)
    expected = 0.2
    for kl, n in [(3.0, 64), (12.0, 64), (6.6, 128), (torch.tensor(5.7), 32), (0.0, 512)]:
        c.update(kl, n_steps=n)
        err = float(kl) / 6.0 - 1.0
        err = -0.2 if err < -0.2 else 0.2 if err > 0.2 else err
        expected = expected * (1 + err * n / 10_000)
        assert abs(c.value - expected) < 1e-15


def test_adaptive_controller_raises_coef_when_kl_is_high_and_lowers_when_low():
    hi = make_kl_controller("adaptive", kl_coef=0.1, target_kl=1.0, horizon=100)
    lo = make_kl_controller("adaptive", kl_coef=0.1, target_kl=1.0, horizon=100)
    for _ in range(5):
        hi.update(2.0, n_steps=10)
        lo.update(0.5, n_steps=10)
    assert hi.value > 0.1 > lo.value


def test_controller_state_round_trips_and_continues_identically():
    a = make_kl_controller("adaptive", kl_coef=0.3, target_kl=2.0, horizon=500)
    for kl in (1.0, 3.0, 2.5):
        a.update(kl, n_steps=16)
    state = a.state_dict()
    b = make_kl_controller("adaptive", kl_coef=99.0, target_kl=2.0, horizon=500)
    b.load_state_dict(state)
    assert b.value == a.value
    for kl in (0.1, 4.0):
        a.update(kl, n_steps=16)
        b.update(kl, n_steps=16)
    assert a.value == b.value
    f = make_kl_controller("fixed", kl_coef=0.1)
    with pytest.raises(ValueError, match="adaptive"):
        f.load_state_dict(state)


def test_controller_config_errors():
    with pytest.raises(ValueError, match="fixed"):
        make_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(TypeError, match="target"):
        make_kl_controller("adaptive", kl_coef=0.1, target=1.0, horizon=10)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.0, horizon=10)
    with pytest.raises(ValueError, match="NaN"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=1.0, horizon=10).update(
            float("nan"), 4
        )


# ------------------------------------------------------------------------ KL in reward / as loss


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_apply_kl_in_reward_equals_loop(estimator):
    lp, ref, mask = _pair(4)
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(lp.shape, generator=gen, dtype=torch.float64)
    rewards, m = apply_kl_in_reward(scores, lp, ref, mask, kl_coef=0.07, estimator=estimator)
    seq_kls = []
    for i in range(lp.shape[0]):
        pos = valid_positions(mask, i)
        kls = []
        for t in range(lp.shape[1]):
            if t in pos:
                k = _ref_estimator(estimator, float(lp[i, t]), float(ref[i, t]))
                kls.append(k)
                assert abs(rewards[i, t].item() - (float(scores[i, t]) - 0.07 * k)) < TOL
            else:
                assert rewards[i, t].item() == 0.0
        if pos:
            seq_kls.append(sum(kls) / len(kls))
    assert abs(m["kl"].item() - sum(seq_kls) / len(seq_kls)) < TOL
    assert abs(m["kl_coef"].item() - 0.07) < TOL


def test_apply_kl_in_reward_feeds_the_adaptive_controller():
    lp, ref, mask = _pair(6)
    ctrl = make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.01, horizon=100)
    scores = torch.zeros_like(lp)
    _, m = apply_kl_in_reward(scores, lp, ref, mask, kl_coef=ctrl.value, estimator="k3")
    ctrl.update(m["kl"], n_steps=lp.shape[0])
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * lp.shape[0] / 100), abs=1e-15)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_kl_loss_equals_loop_and_scales_by_coef(mode):
    lp, ref, mask = _pair(7, scale=0.3)
    lp.requires_grad_()
    loss, m = kl_loss(lp, ref, mask, kl_coef=0.01, estimator="k3", loss_agg_mode=mode)
    mat = [
        [_ref_estimator("k3", lp[i, t].item(), ref[i, t].item()) for t in range(lp.shape[1])]
        for i in range(lp.shape[0])
    ]
    expected = ref_agg(mat, mask, mode)
    assert abs(m["kl_loss"].item() - expected) < TOL
    assert abs(loss.item() - 0.01 * expected) < TOL
    (g,) = torch.autograd.grad(loss, lp)
    assert bool((g[~mask] == 0).all()) and bool((g[mask] != 0).any())


def test_kl_loss_gradcheck():
    lp, ref, mask = _pair(8, batch=3, length=4, scale=0.3)
    assert torch.autograd.gradcheck(
        lambda x: kl_loss(x, ref, mask, kl_coef=0.5, estimator="k3")[0], (lp.requires_grad_(),)
    )


def test_kl_with_non_finite_ref_at_valid_position_is_an_error_but_padding_is_ignored():
    lp, ref, mask = _pair(9)
    ref_pad = ref.clone()
    ref_pad[~mask] = float("-inf")
    a, _ = kl_loss(lp, ref, mask, kl_coef=1.0)
    b, _ = kl_loss(lp, ref_pad, mask, kl_coef=1.0)
    assert a.item() == b.item()
    ref_bad = ref.clone()
    ref_bad[tuple(mask.nonzero()[0].tolist())] = float("nan")
    with pytest.raises(ValueError, match="ref_log_prob"):
        kl_loss(lp, ref_bad, mask, kl_coef=1.0)
    with pytest.raises(ValueError, match="ref_log_prob"):
        apply_kl_in_reward(torch.zeros_like(lp), lp, ref_bad, mask, kl_coef=0.1)
