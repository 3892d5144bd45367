"""Policy losses against the loop references in test_algos_refs, gradients, properties, degenerate
inputs. Tolerances: float64 everywhere, 1e-10 absolute for values and gradients vs references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algos import AGG_MODES, compute_policy_loss
from tests.unit.test_algos_refs import (
    ragged_mask,
    ref_gspo_seq_loss,
    ref_ppo_loss,
    ref_ppo_token,
    valid_positions,
)

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
TOL = 1e-10


def _inputs(seed: int, batch: int = 6, length: int = 7, spread: float = 0.5, probe: bool = True):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(gen, batch, length)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    new = old + spread * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    # Every other row starts with an exploded ratio (e^1.5 > clip_ratio_c) on a negative advantage,
    # so the dual clip is exercised; the first token of a non-empty row is always valid.
    if probe:
        new[::2, 0] = old[::2, 0] + 1.5
        adv[::2, 0] = -adv[::2, 0].abs()
    return old, new, adv, mask


def test_all_aggregation_modes_are_covered():
    assert set(AGG_MODES.names()) == set(MODES)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "low,high,c", [(0.2, 0.2, 3.0), (0.1, 0.28, 3.0), (0.2, 0.2, None), (0.2, 0.3, 1.5)]
)
def test_ppo_clip_value_and_grad_equal_loop_reference(mode, low, high, c):
    old, new, adv, mask = _inputs(seed=hash((mode, low, high, c)) % 1000)
    new = new.requires_grad_()
    hp = {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": c}
    loss, _ = compute_policy_loss(
        "ppo_clip",
        old_log_prob=old,
        log_prob=new,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=mode,
        **hp,
    )
    (grad,) = torch.autograd.grad(loss, new)

    new_ref = new.detach().clone().requires_grad_()
    ref = ref_ppo_loss(old, new_ref, adv, mask, mode, low, high, c)
    (grad_ref,) = torch.autograd.grad(ref, new_ref)
    assert abs(loss.item() - ref.item()) < TOL
    assert torch.allclose(grad, grad_ref, atol=TOL, rtol=0)
    assert bool((grad[~mask] == 0).all())


def test_ppo_clip_metrics_equal_loop_counts():
    old, new, adv, mask = _inputs(seed=3, spread=0.6)
    _, m = compute_policy_loss(
        "ppo_clip", old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask
    )
    n = clipped = lower = 0
    kl, ratios = 0.0, []
    for i in range(mask.shape[0]):
        for t in valid_positions(mask, i):
            r = float(torch.exp(new[i, t] - old[i, t]))
            a = float(adv[i, t])
            n += 1
            clipped += int(-a * min(max(r, 0.8), 1.2) > -a * r)
            lower += int(a < 0 and max(-a * r, -a * min(max(r, 0.8), 1.2)) > -a * 3.0)
            kl += float(old[i, t] - new[i, t])
            ratios.append(r)
    assert clipped > 0 and lower > 0, "inputs must exercise both clips"
    assert abs(float(m["pg_clipfrac"]) - clipped / n) < TOL
    assert abs(float(m["pg_clipfrac_lower"]) - lower / n) < TOL
    assert abs(float(m["ppo_kl"]) - kl / n) < TOL
    assert abs(float(m["ratio_mean"]) - sum(ratios) / n) < TOL
    assert abs(float(m["ratio_max"]) - max(ratios)) < TOL
    assert abs(float(m["ratio_min"]) - min(ratios)) < TOL
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in m.values())


def test_ppo_clip_passes_gradcheck():
    old, new, adv, mask = _inputs(seed=5, batch=3, length=5)

    def f(lp):
        return compute_policy_loss(
            "ppo_clip",
            old_log_prob=old,
            log_prob=lp,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode="seq-mean-token-mean",
        )[0]

    assert torch.autograd.gradcheck(f, (new.clone().requires_grad_(),))


@pytest.mark.parametrize("spread", [1e-4, 0.05])
def test_gspo_value_and_grad_equal_sequence_level_reference(spread):
    old, new, _, mask = _inputs(seed=11, spread=spread, probe=False)
    gen = torch.Generator().manual_seed(12)
    adv_seq = torch.randn(mask.shape[0], generator=gen, dtype=torch.float64)
    adv = adv_seq[:, None].expand_as(old).clone()
    new = new.requires_grad_()
    loss, m = compute_policy_loss(
        "gspo",
        old_log_prob=old,
        log_prob=new,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="seq-mean-token-mean",
    )
    (grad,) = torch.autograd.grad(loss, new)
    new_ref = new.detach().clone().requires_grad_()
    ref = ref_gspo_seq_loss(old, new_ref, adv_seq.tolist(), mask, 3e-4, 4e-4)
    (grad_ref,) = torch.autograd.grad(ref, new_ref)
    assert abs(loss.item() - ref.item()) < TOL
    assert torch.allclose(grad, grad_ref, atol=TOL, rtol=0)
    if spread > 0.01:
        assert float(m["pg_clipfrac"]) > 0  # the tiny clip range is hit


def test_gspo_passes_gradcheck():
    # The token form's stop-gradients make its autograd gradient the sequence-level one only for
    # seq-mean-token-mean with one advantage per sequence, which is what finite differences see.
    old, new, adv, mask = _inputs(seed=13, batch=3, length=5, spread=1e-4, probe=False)
    adv = adv[:, :1].expand_as(adv).clone()

    def f(lp):
        return compute_policy_loss(
            "gspo",
            old_log_prob=old,
            log_prob=lp,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode="seq-mean-token-mean",
        )[0]

    assert torch.autograd.gradcheck(f, (new.clone().requires_grad_(),))


def test_rollout_is_weights_scale_each_token_loss():
    old, new, adv, mask = _inputs(seed=21)
    gen = torch.Generator().manual_seed(22)
    w = torch.rand(old.shape, generator=gen, dtype=torch.float64) * 2
    loss, _ = compute_policy_loss(
        "ppo_clip",
        old_log_prob=old,
        log_prob=new,
        advantages=adv,
        response_mask=mask,
        rollout_is_weights=w,
    )
    total, n = 0.0, 0
    for i in range(mask.shape[0]):
        for t in valid_positions(mask, i):
            tok = ref_ppo_token(float(old[i, t]), float(new[i, t]), float(adv[i, t]), 0.2, 0.2, 3.0)
            total += float(w[i, t]) * tok
            n += 1
    assert abs(loss.item() - total / n) < TOL


# ------------------------------------------------------------------------------------ properties

_floats = st.floats(-5, 5, allow_nan=False, width=64)


@settings(max_examples=60, deadline=None)
@given(
    log_ratio=st.lists(st.floats(-8, 8, width=64), min_size=1, max_size=12),
    adv_mag=st.lists(st.floats(0.01, 10, width=64), min_size=12, max_size=12),
    c=st.floats(1.05, 10, width=64),
    low=st.floats(0.0, 0.5, width=64),
    high=st.floats(0.0, 2.0, width=64),
)
def test_dual_clip_bounds_negative_advantage_loss(log_ratio, adv_mag, c, low, high):
    n = len(log_ratio)
    old = torch.zeros(1, n, dtype=torch.float64)
    new = torch.tensor([log_ratio], dtype=torch.float64)
    adv = -torch.tensor([adv_mag[:n]], dtype=torch.float64)
    mask = torch.ones(1, n, dtype=torch.bool)
    for t in range(n):
        m = torch.zeros_like(mask)
        m[0, t] = True
        loss, _ = compute_policy_loss(
            "ppo_clip",
            old_log_prob=old,
            log_prob=new,
            advantages=adv,
            response_mask=m,
            clip_ratio_c=c,
            clip_ratio_low=low,
            clip_ratio_high=high,
        )
        assert loss.item() <= c * abs(float(adv[0, t])) * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(
    adv=st.lists(_floats, min_size=2, max_size=10),
    lengths=st.lists(st.integers(0, 5), min_size=2, max_size=2),
    mode=st.sampled_from(["token-mean", "seq-mean-token-mean"]),
    c=st.one_of(st.none(), st.floats(1.01, 5, width=64)),
)
def test_ppo_clip_at_ratio_one_is_minus_mean_advantage(adv, lengths, mode, c):
    length = 5
    a = torch.zeros(2, length, dtype=torch.float64)
    mask = torch.zeros(2, length, dtype=torch.bool)
    vals = iter(adv * 10)
    for i, n in enumerate(lengths):
        for t in range(n):
            a[i, t] = next(vals)
            mask[i, t] = True
    lp = torch.full((2, length), -1.3, dtype=torch.float64)
    loss, m = compute_policy_loss(
        "ppo_clip",
        old_log_prob=lp,
        log_prob=lp.clone(),
        advantages=a,
        response_mask=mask,
        loss_agg_mode=mode,
        clip_ratio_c=c,
    )
    if mode == "token-mean":
        expected = -sum(float(a[mask][k]) for k in range(int(mask.sum()))) / max(int(mask.sum()), 1)
    else:
        per_seq = [-float(a[i, :n].sum()) / n for i, n in enumerate(lengths) if n > 0]
        expected = sum(per_seq) / max(len(per_seq), 1)
    assert abs(loss.item() - expected) < 1e-12
    assert float(m["pg_clipfrac"]) == 0.0


# ------------------------------------------------------------------------------ degenerate input


def test_nan_and_inf_in_padding_do_not_reach_loss_or_gradient():
    old, new, adv, mask = _inputs(seed=31)
    new = new.requires_grad_()
    clean, _ = compute_policy_loss(
        "ppo_clip", old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask
    )
    (g_clean,) = torch.autograd.grad(clean, new)
    pad = ~mask
    old_d, adv_d = old.clone(), adv.clone()
    old_d[pad] = float("nan")
    adv_d[pad] = float("inf")
    new_d = new.detach().clone()
    new_d[pad] = float("-inf")
    new_d.requires_grad_()
    dirty, _ = compute_policy_loss(
        "ppo_clip", old_log_prob=old_d, log_prob=new_d, advantages=adv_d, response_mask=mask
    )
    (g_dirty,) = torch.autograd.grad(dirty, new_d)
    assert dirty.item() == clean.item()
    assert torch.equal(g_dirty, g_clean)


@pytest.mark.parametrize("field", ["old_log_prob", "log_prob", "advantages"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_at_a_valid_position_is_a_clear_error(field, bad):
    old, new, adv, mask = _inputs(seed=32)
    tensors = {"old_log_prob": old, "log_prob": new, "advantages": adv}
    i, t = [int(x) for x in mask.nonzero()[0]]
    tensors[field] = tensors[field].clone()
    tensors[field][i, t] = bad
    with pytest.raises(ValueError, match=field):
        compute_policy_loss("ppo_clip", response_mask=mask, **tensors)


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_batch_gives_zero_loss_and_zero_grad(mode):
    old, new, adv, _ = _inputs(seed=33)
    mask = torch.zeros_like(old, dtype=torch.bool)
    new = new.requires_grad_()
    loss, m = compute_policy_loss(
        "ppo_clip",
        old_log_prob=old,
        log_prob=new,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=mode,
    )
    (grad,) = torch.autograd.grad(loss, new)
    assert loss.item() == 0.0 and bool((grad == 0).all())
    assert all(bool(torch.isfinite(v)) for v in m.values())


def test_extreme_log_ratio_stays_finite():
    old = torch.tensor([[-200.0, -1.0]], dtype=torch.float64)
    new = torch.tensor([[-1.0, -200.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = compute_policy_loss(
        "ppo_clip", old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask
    )
    (grad,) = torch.autograd.grad(loss, new)
    # token 0: A<0, exploded ratio -> dual clip caps it at 3 |A|; token 1: A>0, ratio e^-20 (the
    # clamp) -> max(-A r, -A * 0.8) = -A r ~ 0: PPO never clips a positive advantage from below.
    assert abs(loss.item() - (3.0 - math.exp(-20.0)) / 2) < 1e-12
    assert bool(torch.isfinite(grad).all())


# ---------------------------------------------------------------------------------- config errors


def test_unknown_hyperparameters_are_named():
    old, new, adv, mask = _inputs(seed=41)
    with pytest.raises(TypeError, match=r"clip_ratio_hi.*clip_ratoi"):
        compute_policy_loss(
            "ppo_clip",
            old_log_prob=old,
            log_prob=new,
            advantages=adv,
            response_mask=mask,
            clip_ratio_hi=0.3,
            clip_ratoi=0.1,
        )
    with pytest.raises(TypeError, match="clip_ratio_c"):
        compute_policy_loss(
            "gspo",
            old_log_prob=old,
            log_prob=new,
            advantages=adv,
            response_mask=mask,
            clip_ratio_c=3,
        )
    with pytest.raises(TypeError, match="norm_lenght"):
        compute_policy_loss(
            "ppo_clip",
            old_log_prob=old,
            log_prob=new,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode="seq-mean-token-sum-norm",
            loss_agg_kwargs={"norm_lenght": 4},
        )


def test_unknown_loss_and_mode_list_the_known_names():
    old, new, adv, mask = _inputs(seed=42)
    with pytest.raises(ValueError, match=r"known: gspo, ppo_clip"):
        compute_policy_loss(
            "ppo", old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask
        )
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        compute_policy_loss(
            "ppo_clip",
            old_log_prob=old,
            log_prob=new,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode="mean",
        )


@pytest.mark.parametrize(
    "hp", [{"clip_ratio_c": 1.0}, {"clip_ratio_low": 1.0}, {"clip_ratio_high": -0.1}]
)
def test_invalid_clip_values_raise(hp):
    old, new, adv, mask = _inputs(seed=43)
    with pytest.raises(ValueError, match=next(iter(hp))):
        compute_policy_loss(
            "ppo_clip", old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, **hp
        )


def test_shape_mismatch_raises():
    old, new, adv, mask = _inputs(seed=44)
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_policy_loss(
            "ppo_clip", old_log_prob=old, log_prob=new[:, :-1], advantages=adv, response_mask=mask
        )
