"""Advantage estimators against loop references (float64, 1e-10), properties, degenerate input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megarl.algos import ADV_ESTIMATORS, compute_advantages
from megarl.algos.advantages import gae
from tests.unit.test_algos_refs import (
    broadcast_seq,
    ragged_mask,
    ref_gae,
    ref_grpo_seq,
    ref_returns_to_go,
    ref_rloo_seq,
    ref_whiten,
)

TOL = 1e-10


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _batch(seed: int, batch: int = 8, length: int = 7, holes: bool = True):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(gen, batch, length, holes=holes)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    groups = [f"p{i // 4}" for i in range(batch)]  # uids as strings, two groups of 4
    return rewards, values, mask, groups


def test_registry_has_the_four_estimators():
    assert set(ADV_ESTIMATORS.names()) == {"gae", "grpo", "rloo", "reinforce_plus_plus"}


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
@pytest.mark.parametrize("whiten", [False, True])
def test_gae_equals_forward_sum_reference(gamma, lam, whiten):
    rewards, values, mask, _ = _batch(seed=int(gamma * 100 + lam * 10))
    adv, ret = compute_advantages(
        "gae",
        token_level_rewards=rewards,
        response_mask=mask,
        values=values,
        gamma=gamma,
        lam=lam,
        whiten=whiten,
    )
    ref = ref_gae(rewards, values, mask, gamma, lam)
    ref_ret = [
        [ref[i][t] + float(values[i, t]) if bool(mask[i, t]) else 0.0 for t in range(mask.shape[1])]
        for i in range(mask.shape[0])
    ]
    assert torch.allclose(ret, _t(ref_ret), atol=TOL, rtol=0)
    expected = ref_whiten(ref, mask) if whiten else ref
    assert torch.allclose(adv, _t(expected), atol=TOL, rtol=0)


def test_gae_gradcheck_in_values():
    rewards, values, mask, _ = _batch(seed=1, batch=3, length=5)
    assert torch.autograd.gradcheck(
        lambda v: gae(rewards, mask, v, gamma=0.9, lam=0.8, whiten=False)[0],
        (values.clone().requires_grad_(),),
    )


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 5),
    length=st.integers(1, 8),
)
def test_gae_with_unit_gamma_lambda_is_reward_to_go_minus_values(seed, batch, length):
    rewards, values, mask, _ = _batch(seed, batch, length)
    adv, ret = compute_advantages(
        "gae",
        token_level_rewards=rewards,
        response_mask=mask,
        values=values,
        gamma=1.0,
        lam=1.0,
        whiten=False,
    )
    rtg = ref_returns_to_go(rewards, mask, 1.0)
    for i in range(batch):
        for t in range(length):
            expected = rtg[i][t] - float(values[i, t]) if bool(mask[i, t]) else 0.0
            assert abs(adv[i, t].item() - expected) < TOL
            assert abs(ret[i, t].item() - rtg[i][t]) < TOL


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_equals_group_reference(norm_by_std):
    rewards, _, mask, groups = _batch(seed=2, batch=12)
    groups = [("uid", i % 3) for i in range(12)]  # interleaved tuple uids
    adv, ret = compute_advantages(
        "grpo",
        token_level_rewards=rewards,
        response_mask=mask,
        group_ids=groups,
        norm_by_std=norm_by_std,
    )
    ref = broadcast_seq(ref_grpo_seq(rewards, mask, groups, norm_by_std), mask)
    assert torch.allclose(adv, _t(ref), atol=TOL, rtol=0)
    assert torch.equal(adv, ret)


def test_rloo_equals_leave_one_out_reference():
    rewards, _, mask, groups = _batch(seed=3, batch=12)
    adv, _ = compute_advantages(
        "rloo", token_level_rewards=rewards, response_mask=mask, group_ids=groups
    )
    ref = broadcast_seq(ref_rloo_seq(rewards, mask, groups), mask)
    assert torch.allclose(adv, _t(ref), atol=TOL, rtol=0)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_is_whitened_reward_to_go(gamma):
    rewards, _, mask, _ = _batch(seed=4)
    adv, ret = compute_advantages(
        "reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask, gamma=gamma
    )
    rtg = ref_returns_to_go(rewards, mask, gamma)
    assert torch.allclose(ret, _t(rtg), atol=TOL, rtol=0)
    assert torch.allclose(adv, _t(ref_whiten(rtg, mask)), atol=TOL, rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    scores=st.lists(st.floats(-10, 10, width=64), min_size=2, max_size=16),
    n_groups=st.integers(1, 4),
    norm_by_std=st.booleans(),
)
# nearly equal scores in one group: the centred scores' rounding divided by a std of ~1e-15
@example(scores=[9.999999999999998, 0.0, 10.0], n_groups=2, norm_by_std=True)
def test_grpo_advantages_sum_to_zero_per_group(scores, n_groups, norm_by_std):
    batch = len(scores)
    rewards = torch.zeros(batch, 3, dtype=torch.float64)
    rewards[:, 2] = torch.tensor(scores, dtype=torch.float64)
    mask = torch.ones(batch, 3, dtype=torch.bool)
    groups = [i % n_groups for i in range(batch)]
    adv, _ = compute_advantages(
        "grpo",
        token_level_rewards=rewards,
        response_mask=mask,
        group_ids=groups,
        norm_by_std=norm_by_std,
    )
    for g in range(n_groups):
        rows = [i for i in range(batch) if groups[i] == g]
        if not rows:
            continue
        total = sum(adv[i, 0].item() for i in rows)
        # float64 rounding of the centred scores is ~n * eps * max|score|; the std division scales
        # it by 1 / (std + 1e-6), which is huge when a group's scores are nearly equal.
        group = torch.tensor([scores[i] for i in rows], dtype=torch.float64)
        centred_error = 8 * len(rows) * 2.2e-16 * max(1.0, group.abs().max().item())
        std = group.std().item() if len(rows) > 1 else 0.0
        scale = 1.0 / (std + 1e-6) if norm_by_std else 1.0
        assert abs(total) <= centred_error * scale + 1e-12, (total, centred_error * scale)
        for i in rows:  # one advantage per sequence, on every valid token
            assert torch.all(adv[i] == adv[i, 0])


# ------------------------------------------------------------------------------ degenerate input


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_with_equal_rewards_or_a_single_member_gets_zero(name):
    rewards = torch.zeros(5, 2, dtype=torch.float64)
    rewards[:, 1] = torch.tensor([1.0, 1.0, 1.0, 0.0, 7.0])
    mask = torch.ones(5, 2, dtype=torch.bool)
    adv, _ = compute_advantages(
        name, token_level_rewards=rewards, response_mask=mask, group_ids=["a", "a", "a", "b", "c"]
    )
    assert bool(torch.isfinite(adv).all())
    assert torch.equal(adv[:3], torch.zeros(3, 2, dtype=torch.float64))  # zero std group
    assert torch.equal(adv[3:], torch.zeros(2, 2, dtype=torch.float64))  # singletons


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_all_masked_row_gets_zero_and_is_left_out_of_its_group(name):
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]], dtype=torch.bool)
    adv, _ = compute_advantages(
        name, token_level_rewards=rewards, response_mask=mask, group_ids=[0, 0, 0]
    )
    assert torch.equal(adv[2], torch.zeros(2, dtype=torch.float64))
    expected = {"grpo": 1.0 / (2**0.5 + 1e-6), "rloo": 2.0}[name]
    assert abs(adv[1, 0].item() - expected) < 1e-12
    assert abs(adv[0, 0].item() + expected) < 1e-12


def test_gae_all_masked_row_is_zero_and_does_not_move_the_whitening():
    rewards, values, mask, _ = _batch(seed=5, holes=False)
    mask[0] = False
    adv, ret = compute_advantages(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values
    )
    assert torch.equal(adv[0], torch.zeros_like(adv[0]))
    assert torch.equal(ret[0], torch.zeros_like(ret[0]))
    adv_rest, _ = compute_advantages(
        "gae", token_level_rewards=rewards[1:], response_mask=mask[1:], values=values[1:]
    )
    assert torch.allclose(adv[1:], adv_rest, atol=TOL, rtol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "reinforce_plus_plus"])
def test_non_finite_reward_at_a_valid_position_is_a_clear_error(bad, name):
    rewards, values, mask, groups = _batch(seed=6)
    rewards[0, 0] = bad  # the first token of a row is valid unless the row is empty
    mask[0, 0] = True
    extra = {
        "gae": {"values": values},
        "grpo": {"group_ids": groups},
        "rloo": {"group_ids": groups},
    }
    with pytest.raises(ValueError, match="token_level_rewards"):
        compute_advantages(
            name, token_level_rewards=rewards, response_mask=mask, **extra.get(name, {})
        )


def test_non_finite_in_padding_is_ignored():
    rewards, values, mask, groups = _batch(seed=7)
    clean = compute_advantages(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values
    )
    r2, v2 = rewards.clone(), values.clone()
    r2[~mask] = float("nan")
    v2[~mask] = float("inf")
    dirty = compute_advantages("gae", token_level_rewards=r2, response_mask=mask, values=v2)
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    g_clean = compute_advantages(
        "grpo", token_level_rewards=rewards, response_mask=mask, group_ids=groups
    )[0]
    g_dirty = compute_advantages(
        "grpo", token_level_rewards=r2, response_mask=mask, group_ids=groups
    )[0]
    assert torch.equal(g_clean, g_dirty)


def test_nan_in_values_is_a_clear_error():
    rewards, values, mask, _ = _batch(seed=8)
    values[mask.nonzero()[0].tolist()] = float("nan")
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", token_level_rewards=rewards, response_mask=mask, values=values)


# ---------------------------------------------------------------------------------- config errors


def test_missing_and_unexpected_inputs_are_named():
    rewards, values, mask, groups = _batch(seed=9)
    with pytest.raises(TypeError, match="group_ids"):
        compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(TypeError, match="values"):
        compute_advantages("gae", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(TypeError, match="values"):
        compute_advantages(
            "grpo", token_level_rewards=rewards, response_mask=mask, values=values, group_ids=groups
        )
    with pytest.raises(TypeError, match="lambda"):
        compute_advantages(
            "gae", token_level_rewards=rewards, response_mask=mask, values=values, **{"lambda": 0.9}
        )
    with pytest.raises(ValueError, match=r"gae, grpo, reinforce_plus_plus, rloo"):
        compute_advantages("ppo", token_level_rewards=rewards, response_mask=mask)


def test_group_ids_of_the_wrong_length_are_an_error():
    rewards, _, mask, groups = _batch(seed=10)
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages(
            "grpo", token_level_rewards=rewards, response_mask=mask, group_ids=groups[:-1]
        )


def test_advantages_carry_no_graph():
    rewards, values, mask, _ = _batch(seed=11)
    adv, ret = compute_advantages(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values.requires_grad_()
    )
    assert not adv.requires_grad and not ret.requires_grad
