"""Environment tokens carry no gradient: with the response mask of a multi-turn trajectory, the
actor loss (policy loss + KL loss + entropy bonus, every aggregation mode) and the critic loss
have zero gradient at the masked positions, whatever values sit there; GAE runs over model tokens
only (values and rewards at environment tokens change nothing)."""

from __future__ import annotations

import pytest
import torch

from megarl.algos import compute_advantages
from megarl.algos.choices import resolve_algorithm_kwargs
from megarl.config import RunConfig
from megarl.trainer.batch import Samples
from megarl.trainer.losses import make_critic_loss
from megarl.trainer.token_tensors import TokenTensors
from tests.policy_terms import policy_terms

pytestmark = pytest.mark.unit

# two trajectories: model turn, environment tokens, model turn (and padding in the second)
MASK = torch.tensor(
    [
        [1, 1, 1, 0, 0, 0, 1, 1, 1, 1],
        [1, 1, 0, 0, 1, 1, 1, 0, 0, 0],
    ],
    dtype=torch.float32,
)
ENV = MASK == 0


def _samples(noise: float) -> Samples:
    """Samples whose tensors hold ``noise`` * large values at the masked positions."""
    gen = torch.Generator().manual_seed(0)
    n, r = MASK.shape
    wild = noise * 100 * torch.randn(n, r, generator=gen) * ENV

    def t(scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(n, r, generator=gen) * MASK + wild

    return Samples(
        input_ids=torch.zeros(n, r + 3, dtype=torch.long),
        prompt_lens=torch.tensor([3, 3]),
        response_lens=torch.tensor([10, 7]),
        group_ids=[0, 0],
        response_mask=MASK.clone(),
        tensors=TokenTensors(
            advantages=t(),
            old_log_prob=t(0.1) - 1.0,
            ref_log_prob=t(0.1) - 1.0,
            values=t(),
            returns=t(),
        ),
    )


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_actor_loss_has_no_gradient_at_environment_tokens(agg):
    cfg = RunConfig()
    cfg.algorithm.loss_agg_mode = agg
    cfg.algorithm.entropy_coef = 0.01
    cfg.actor.ppo_epochs = 2  # old logprobs from the rollout, not the update
    terms = policy_terms(cfg)
    for noise in (0.0, 1.0):
        mb = _samples(noise)
        logp = (
            mb.tensors.require("old_log_prob") + 0.05 * torch.randn(MASK.shape)
        ).requires_grad_()
        entropy = torch.rand(MASK.shape).requires_grad_()
        loss, _ = terms(logp, entropy, mb)
        loss.backward()
        assert logp.grad[ENV].abs().max() == 0 and entropy.grad[ENV].abs().max() == 0
        assert logp.grad[MASK.bool()].abs().max() > 0


def test_critic_loss_has_no_gradient_at_environment_tokens():
    cfg = RunConfig()
    loss_fn = make_critic_loss(
        cfg.algorithm,
        resolve_algorithm_kwargs(cfg.algorithm, cfg.rollout.sampling),
        cfg.critic.cliprange_value,
    )
    mb = _samples(1.0)
    output = torch.randn(*MASK.shape, 1).requires_grad_()
    loss, _ = loss_fn(output, mb)
    loss.backward()
    assert (
        output.grad[..., 0][ENV].abs().max() == 0
        and output.grad[..., 0][MASK.bool()].abs().max() > 0
    )


def test_gae_runs_over_model_tokens_only():
    gen = torch.Generator().manual_seed(1)
    rewards = torch.zeros(MASK.shape)
    rewards[0, 9], rewards[1, 6] = 1.0, -1.0
    values = torch.randn(MASK.shape, generator=gen)
    base, returns = compute_advantages(
        "gae", token_level_rewards=rewards, response_mask=MASK, values=values, gamma=0.9, lam=0.8
    )
    noisy_values = values + 50 * torch.randn(MASK.shape, generator=gen) * ENV
    noisy_rewards = rewards + 50 * torch.randn(MASK.shape, generator=gen) * ENV
    moved, moved_returns = compute_advantages(
        "gae",
        token_level_rewards=noisy_rewards,
        response_mask=MASK,
        values=noisy_values,
        gamma=0.9,
        lam=0.8,
    )
    assert torch.equal(base, moved) and torch.equal(returns, moved_returns)
    assert base[ENV].abs().max() == 0
    # across the environment span, the model's last token before it bootstraps from the value of
    # the model's next token (one step of the recursion), not from the environment's
    assert base[0, 2] != 0
