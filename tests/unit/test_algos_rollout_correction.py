"""The off-policy corrections of megarl.algos.rollout_correction against references written from
each paper's formula, token by token in Python floats (float64 inputs, 1e-12).

With ``rho_t = pi_old(y_t) / pi_rollout(y_t)`` (trainer before the update over the behaviour
policy):
- token TIS (Yao et al. 2025): ``w_t = min(rho_t, C)``;
- sequence TIS (Liu et al. 2025): ``w_i = min(prod_t rho_it, C)`` on every token of sequence i;
- masked IS (Liu et al. 2025, MIS): ``w_i = rho_i * 1[low <= rho_i <= high]`` (sequence, or token);
- IcePop (Ling team 2025): ``M(k) = k if alpha <= k <= beta else 0`` per token;
- decoupled PPO (Hilton et al. 2022, AReaL's cap): ``w_t = pi_prox / pi_behav``, 0 above the cap.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algos import ROLLOUT_CORRECTIONS, compute_policy_loss, compute_rollout_correction
from tests.unit.test_algos_refs import ragged_mask, ref_ppo_token, valid_positions

pytestmark = pytest.mark.unit

TOL = 1e-12


def _inputs(seed: int, batch: int = 8, length: int = 6, spread: float = 0.6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    rollout = old + spread * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return old, rollout, ragged_mask(gen, batch, length)


def _rho(old, rollout, i: int, t: int) -> float:
    return math.exp(float(old[i, t]) - float(rollout[i, t]))


def _seq_rho(old, rollout, mask, i: int) -> float:
    return math.exp(sum(float(old[i, t] - rollout[i, t]) for t in valid_positions(mask, i)))


def _check_weights(w, mask, expected) -> None:
    """``expected(i, t)`` at valid positions, 0 at padding."""
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            want = expected(i, t) if bool(mask[i, t]) else 0.0
            assert abs(float(w[i, t]) - want) < TOL * max(1.0, abs(want)), (i, t, want)


def _tokens(mask) -> list[tuple[int, int]]:
    return [(i, t) for i in range(mask.shape[0]) for t in valid_positions(mask, i)]


def _sequences(mask) -> list[int]:
    return [i for i in range(mask.shape[0]) if valid_positions(mask, i)]


def test_every_correction_is_registered():
    assert set(ROLLOUT_CORRECTIONS.names()) >= {
        "none",
        "token_tis",
        "seq_tis",
        "masked_is",
        "icepop",
        "decoupled_ppo",
    }


def test_token_tis_is_the_truncated_token_ratio():
    old, rollout, mask = _inputs(4)
    cap = 1.5
    w, m = compute_rollout_correction("token_tis", old, rollout, mask, cap=cap)
    _check_weights(w, mask, lambda i, t: min(_rho(old, rollout, i, t), cap))
    raws = [_rho(old, rollout, i, t) for i, t in _tokens(mask)]
    clipped = sum(r > cap for r in raws)
    assert 0 < clipped < len(raws)
    assert abs(float(m["correction/clip_frac"]) - clipped / len(raws)) < TOL
    assert (
        abs(float(m["correction/weight_mean"]) - sum(min(r, cap) for r in raws) / len(raws)) < TOL
    )
    assert abs(float(m["correction/raw_weight_max"]) - max(raws)) < 1e-9
    assert abs(float(m["correction/raw_weight_min"]) - min(raws)) < 1e-9


def test_mismatch_metrics_against_their_definitions():
    old, rollout, mask = _inputs(5)
    _, m = compute_rollout_correction("token_tis", old, rollout, mask)
    toks = _tokens(mask)
    d = [float(rollout[i, t] - old[i, t]) for i, t in toks]  # log(pi_rollout / pi_old)
    assert abs(float(m["mismatch/k1"]) - sum(d) / len(d)) < TOL
    k3 = [math.exp(-x) - 1 + x for x in d]
    assert abs(float(m["mismatch/k3"]) - sum(k3) / len(k3)) < TOL
    assert abs(float(m["mismatch/abs_diff_mean"]) - sum(map(abs, d)) / len(d)) < TOL
    assert abs(float(m["mismatch/abs_diff_max"]) - max(map(abs, d))) < TOL
    ppl = []
    for i in _sequences(mask):
        pos = valid_positions(mask, i)
        ppl.append(math.exp(sum(float(rollout[i, t] - old[i, t]) for t in pos) / len(pos)))
    assert abs(float(m["mismatch/ppl_ratio_mean"]) - sum(ppl) / len(ppl)) < TOL


def test_seq_tis_is_the_truncated_sequence_ratio_on_every_token():
    old, rollout, mask = _inputs(6, spread=0.3)
    cap = 2.0
    w, m = compute_rollout_correction("seq_tis", old, rollout, mask, cap=cap)
    _check_weights(w, mask, lambda i, t: min(_seq_rho(old, rollout, mask, i), cap))
    seqs = [_seq_rho(old, rollout, mask, i) for i in _sequences(mask)]
    assert abs(float(m["correction/clip_frac"]) - sum(r > cap for r in seqs) / len(seqs)) < TOL
    assert abs(float(m["correction/raw_weight_max"]) - max(seqs)) < 1e-9 * max(seqs)


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_masked_is_keeps_the_ratio_inside_the_band_and_drops_the_rest(level):
    old, rollout, mask = _inputs(7, spread=0.4)
    low, high = 0.5, 2.0

    def unit(i: int, t: int) -> float:
        return _seq_rho(old, rollout, mask, i) if level == "sequence" else _rho(old, rollout, i, t)

    w, m = compute_rollout_correction(
        "masked_is", old, rollout, mask, low=low, high=high, level=level
    )
    _check_weights(w, mask, lambda i, t: unit(i, t) if low <= unit(i, t) <= high else 0.0)
    toks = _tokens(mask)
    dropped = [not low <= unit(i, t) <= high for i, t in toks]
    assert 0 < sum(dropped) < len(toks)
    assert abs(float(m["correction/mask_frac"]) - sum(dropped) / len(toks)) < TOL
    units = (
        [unit(i, 0) for i in _sequences(mask)] if level == "sequence" else [unit(*x) for x in toks]
    )
    assert (
        abs(float(m["correction/masked_high_frac"]) - sum(u > high for u in units) / len(units))
        < TOL
    )
    assert (
        abs(float(m["correction/masked_low_frac"]) - sum(u < low for u in units) / len(units)) < TOL
    )


def test_masked_is_default_is_liu_et_al_sequence_mis():
    # MIS: w_i = rho_i * 1[rho_i <= C], C = 2, one-sided
    old, rollout, mask = _inputs(8, spread=0.3)
    w, _ = compute_rollout_correction("masked_is", old, rollout, mask)

    def mis(i: int, t: int) -> float:
        rho = _seq_rho(old, rollout, mask, i)
        return rho if rho <= 2.0 else 0.0

    _check_weights(w, mask, mis)


def test_icepop_masks_both_tails_of_the_token_ratio():
    old, rollout, mask = _inputs(9, spread=1.0)
    alpha, beta = 0.5, 5.0  # the paper's values, icepop's defaults
    w, m = compute_rollout_correction("icepop", old, rollout, mask)

    def icepop(i: int, t: int) -> float:
        k = _rho(old, rollout, i, t)
        return k if alpha <= k <= beta else 0.0

    _check_weights(w, mask, icepop)
    ks = [_rho(old, rollout, i, t) for i, t in _tokens(mask)]
    assert any(k < alpha for k in ks) and any(k > beta for k in ks)  # both tails exercised
    assert (
        abs(float(m["correction/mask_frac"]) - sum(not alpha <= k <= beta for k in ks) / len(ks))
        < TOL
    )


@pytest.mark.parametrize("cap", [None, 1.8])
def test_decoupled_ppo_is_the_proximal_over_behaviour_weight_of_arealite(cap):
    old, rollout, mask = _inputs(10)
    kw = {} if cap is None else {"cap": cap}
    w, _ = compute_rollout_correction("decoupled_ppo", old, rollout, mask, **kw)

    def behaviour_weight(i: int, t: int) -> float:
        rho = _rho(old, rollout, i, t)
        return 0.0 if cap is not None and rho > cap else rho

    _check_weights(w, mask, behaviour_weight)


def test_decoupled_ppo_loss_and_gradient_equal_the_decoupled_objective():
    """L = mean_t (pi_prox / pi_behav) * max(-A r, -A clip(r)), r = pi_theta / pi_prox."""
    old, rollout, mask = _inputs(11)
    gen = torch.Generator().manual_seed(12)
    new = (old + 0.1 * torch.randn(old.shape, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(old.shape, generator=gen, dtype=torch.float64)
    w, _ = compute_rollout_correction("decoupled_ppo", old, rollout, mask, cap=3.0)
    loss, _ = compute_policy_loss(
        "ppo_clip",
        old_log_prob=old,
        log_prob=new,
        advantages=adv,
        response_mask=mask,
        rollout_is_weights=w,
    )
    (g,) = torch.autograd.grad(loss, new)
    new_ref = new.detach().clone().requires_grad_()
    total, n = 0.0, 0
    for i, t in _tokens(mask):
        rho = _rho(old, rollout, i, t)
        weight = rho if rho <= 3.0 else 0.0
        tok = ref_ppo_token(float(old[i, t]), new_ref[i, t], float(adv[i, t]), 0.2, 0.2, 3.0)
        total = total + weight * tok
        n += 1
    (g_ref,) = torch.autograd.grad(total / n, new_ref)
    assert abs(loss.item() - (total / n).item()) < TOL
    assert torch.allclose(g, g_ref, atol=TOL, rtol=0)


def test_none_gives_no_weights_but_the_mismatch():
    old, rollout, mask = _inputs(13)
    w, m = compute_rollout_correction("none", old, rollout, mask)
    assert w is None
    assert set(m) == {
        "mismatch/k1",
        "mismatch/k3",
        "mismatch/abs_diff_mean",
        "mismatch/abs_diff_max",
        "mismatch/ppl_ratio_mean",
    }


def test_refusals_and_padding():
    old, rollout, mask = _inputs(14)
    with pytest.raises(ValueError, match="keeps no ratio"):
        compute_rollout_correction("masked_is", old, rollout, mask, low=2.0, high=1.0)
    with pytest.raises(ValueError, match="keeps no ratio"):
        compute_rollout_correction("icepop", old, rollout, mask, alpha=0.0, beta=0.0)
    with pytest.raises(ValueError, match="token, sequence"):
        compute_rollout_correction("masked_is", old, rollout, mask, level="batch")
    with pytest.raises(ValueError, match="cap"):
        compute_rollout_correction("token_tis", old, rollout, mask, cap=0.0)
    with pytest.raises(TypeError, match="unknown hyperparameter"):
        compute_rollout_correction("token_tis", old, rollout, mask, alpha=1.0)
    bad = rollout.clone()
    bad[tuple(mask.nonzero()[0].tolist())] = float("-inf")
    with pytest.raises(ValueError, match="rollout_log_prob"):
        compute_rollout_correction("icepop", old, bad, mask)
    rollout[~mask] = float("nan")  # padding may hold anything
    for name in ("token_tis", "seq_tis", "masked_is", "icepop", "decoupled_ppo"):
        w, m = compute_rollout_correction(name, old, rollout, mask)
        assert bool(torch.isfinite(w).all()) and bool((w[~mask] == 0).all()), name
        assert all(bool(torch.isfinite(v)) for v in m.values()), name
