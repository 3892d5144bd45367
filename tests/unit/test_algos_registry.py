"""The registry: names -> functions, loud errors, and "a new loss is one function"."""

from __future__ import annotations

import uuid

import pytest
import torch

from megarl.algos import (
    POLICY_LOSSES,
    DuplicateNameError,
    Registry,
    UnknownNameError,
    compute_policy_loss,
    register_adv_estimator,
    register_policy_loss,
)
from megarl.algos import compute_advantages as _compute_advantages


def test_unknown_name_lists_the_known_names():
    reg: Registry = Registry("widget")
    reg.register("b")(lambda: 1)
    reg.register("a")(lambda: 2)
    with pytest.raises(UnknownNameError, match=r"unknown widget 'c'; known: a, b"):
        reg.get("c")
    assert isinstance(UnknownNameError("x"), ValueError)


def test_registering_a_name_twice_is_an_error():
    reg: Registry = Registry("widget")
    reg.register("a")(lambda: 1)
    with pytest.raises(DuplicateNameError, match="'a' is already registered"):
        reg.register("a")(lambda: 2)
    with pytest.raises(DuplicateNameError):
        register_policy_loss("ppo_clip")(lambda *a: None)


def test_call_names_every_unknown_and_missing_keyword():
    reg: Registry = Registry("widget")

    @reg.register("f")
    def f(x, *, alpha: float, beta: float = 1.0):
        return x * alpha * beta

    assert reg.call("f", 2.0, alpha=3.0) == 6.0
    with pytest.raises(TypeError, match=r"unknown hyperparameter\(s\) \['gamma', 'zeta'\]"):
        reg.call("f", 2.0, alpha=1.0, gamma=1, zeta=2)
    with pytest.raises(TypeError, match=r"missing required argument\(s\) \['alpha'\]"):
        reg.call("f", 2.0)
    with pytest.raises(ValueError, match="non-empty"):
        reg.register("")


def test_a_new_policy_loss_is_one_function_and_a_name():
    name = f"test_reinforce_{uuid.uuid4().hex[:8]}"

    @register_policy_loss(name)
    def reinforce(old_log_prob, log_prob, advantages, mask, *, scale: float = 1.0):
        return -scale * advantages * log_prob, {}

    assert name in POLICY_LOSSES
    lp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, 2.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    loss, _ = compute_policy_loss(
        name, old_log_prob=lp.detach(), log_prob=lp, advantages=adv, response_mask=mask, scale=2.0
    )
    assert loss.item() == pytest.approx(-2.0 * (1 * -1 + 2 * -2) / 2, abs=1e-12)
    with pytest.raises(TypeError, match="scael"):
        compute_policy_loss(
            name, old_log_prob=lp, log_prob=lp, advantages=adv, response_mask=mask, scael=2.0
        )


def test_a_new_estimator_is_one_function_and_a_name():
    name = f"test_score_{uuid.uuid4().hex[:8]}"

    @register_adv_estimator(name)
    def score_only(token_level_rewards, mask):
        adv = token_level_rewards.sum(-1, keepdim=True).expand_as(token_level_rewards) * mask
        return adv, adv

    r = torch.tensor([[0.0, 2.0], [1.0, 0.0]], dtype=torch.float64)
    adv, _ = _compute_advantages(name, token_level_rewards=r, response_mask=torch.ones(2, 2))
    assert adv.tolist() == [[2.0, 2.0], [1.0, 1.0]]
