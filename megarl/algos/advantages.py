"""Advantage estimators, registered by name: ``gae``, ``grpo``, ``rloo``, ``reinforce_plus_plus``.

An estimator is ``fn(token_level_rewards, mask, [values=...], [group_ids=...], **hparams)``
returning ``(advantages, returns)``, both [batch, response_len] and 0 at masked positions. It takes
``values`` / ``group_ids`` only if it uses them; :func:`compute_advantages` passes them only when
given, so handing values to an estimator that ignores them is an error, not a silent no-op.

Masked positions inside a response (e.g. tool output in a multi-turn rollout) are skipped by the
recursions: the next valid token is the "next step". Rows with no valid token get advantage 0 and
take no part in group or batch statistics.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from megarl.algos.masked import (
    BatchSum,
    as_bool_mask,
    check_finite,
    check_same_shape,
    local_sum,
    masked_sum,
    masked_whiten,
    zero_masked,
)
from megarl.algos.registry import Registry

ADV_ESTIMATORS: Registry = Registry("advantage estimator")
register_adv_estimator = ADV_ESTIMATORS.register


def _discounted_backward(
    rewards: Tensor, mask: Tensor, gamma: float, lam: float, values: Tensor | None
) -> Tensor:
    """Backward recursion shared by GAE (values given) and discounted returns (values None).

    With values: ``delta_t = r_t + gamma V_next - V_t``, ``A_t = delta_t + gamma lam A_next`` where
    "next" is the next valid token; without: ``G_t = r_t + gamma G_next``.
    """
    batch, length = rewards.shape
    zeros = rewards.new_zeros(batch)
    running = zeros
    next_value = zeros
    out = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        valid = mask[:, t]
        if values is None:
            step = rewards[:, t] + gamma * running
        else:
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            step = delta + gamma * lam * running
            next_value = torch.where(valid, values[:, t], next_value)
        running = torch.where(valid, step, running)
        out[:, t] = torch.where(valid, step, zeros)
    return out


@register_adv_estimator("gae")
def gae(
    token_level_rewards: Tensor,
    mask: Tensor,
    values: Tensor,
    batch_sum: BatchSum = local_sum,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) with a critic.

    ``returns = advantages + values`` is computed before whitening (the critic's target);
    ``whiten`` then normalises the advantages over all valid tokens of the batch (every
    data-parallel rank's, through ``batch_sum``).
    """
    check_same_shape(token_level_rewards=token_level_rewards, values=values)
    values = zero_masked(values, mask)
    advantages = _discounted_backward(token_level_rewards, mask, gamma, lam, values)
    returns = zero_masked(advantages + values, mask)
    if whiten:
        advantages = masked_whiten(advantages, mask, batch_sum=batch_sum)
    return advantages, returns


def _group_index(group_ids: Sequence[Hashable], batch: int, device: torch.device) -> Tensor:
    if len(group_ids) != batch:
        raise ValueError(f"group_ids has {len(group_ids)} entries for a batch of {batch} rows")
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], device=device)


def _group_stats(scores: Tensor, row_valid: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: (count, sum, sum of squared deviations) of its group's valid rows' scores."""
    n_groups = int(group.max()) + 1 if group.numel() else 0
    w = row_valid.to(scores.dtype)
    count = scores.new_zeros(n_groups).index_add_(0, group, w)
    total = scores.new_zeros(n_groups).index_add_(0, group, scores * w)
    mean = total / count.clamp(min=1)
    sq = scores.new_zeros(n_groups).index_add_(0, group, (scores - mean[group]) ** 2 * w)
    return count[group], total[group], sq[group]


def _sequence_scores(token_level_rewards: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    return masked_sum(token_level_rewards, mask, dim=-1), mask.any(dim=-1)


@register_adv_estimator("grpo")
def grpo(
    token_level_rewards: Tensor,
    mask: Tensor,
    group_ids: Sequence[Hashable],
    *,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Group-relative advantage (Shao et al. 2024): ``(score - group mean) / (group std + eps)``.

    ``score`` is the sum of a row's token rewards; the group of a row is its prompt uid; std is
    the unbiased one. A group whose scores are all equal gets advantage 0 (0 / eps); a group of
    one valid row has no baseline and gets 0 too. ``norm_by_std=False`` is Dr. GRPO's variant.
    """
    scores, row_valid = _sequence_scores(token_level_rewards, mask)
    group = _group_index(group_ids, scores.shape[0], scores.device)
    count, total, sq = _group_stats(scores, row_valid, group)
    adv = scores - total / count.clamp(min=1)
    if norm_by_std:
        std = torch.sqrt(sq / (count - 1).clamp(min=1))
        adv = adv / (std + epsilon)
    adv = torch.where(row_valid & (count > 1), adv, torch.zeros_like(adv))
    advantages = zero_masked(adv.unsqueeze(-1).expand_as(token_level_rewards), mask)
    return advantages, advantages.clone()


@register_adv_estimator("rloo")
def rloo(
    token_level_rewards: Tensor, mask: Tensor, group_ids: Sequence[Hashable]
) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): score minus the mean of the others' scores.

    Groups with a single valid row get advantage 0 (there is no "other").
    """
    scores, row_valid = _sequence_scores(token_level_rewards, mask)
    group = _group_index(group_ids, scores.shape[0], scores.device)
    count, total, _ = _group_stats(scores, row_valid, group)
    others_mean = (total - scores) / (count - 1).clamp(min=1)
    adv = torch.where(row_valid & (count > 1), scores - others_mean, torch.zeros_like(scores))
    advantages = zero_masked(adv.unsqueeze(-1).expand_as(token_level_rewards), mask)
    return advantages, advantages.clone()


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus(
    token_level_rewards: Tensor,
    mask: Tensor,
    batch_sum: BatchSum = local_sum,
    *,
    gamma: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go per token, whitened over the whole batch.

    Returns the un-whitened reward-to-go as ``returns``. KL, if wanted, is expected to be in the
    rewards already (:func:`megarl.algos.kl.apply_kl_in_reward`).
    """
    returns = _discounted_backward(token_level_rewards, mask, gamma, 1.0, None)
    return masked_whiten(returns, mask, batch_sum=batch_sum), returns


def compute_advantages(
    name: str,
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None = None,
    group_ids: Sequence[Hashable] | None = None,
    batch_sum: BatchSum | None = None,
    **hparams: object,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns by the named estimator, computed without autograd (they are
    constants for the loss). NaN/inf in rewards or values at a valid position raises ValueError.
    """
    check_same_shape(
        token_level_rewards=token_level_rewards, response_mask=response_mask, values=values
    )
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be [batch, len], got {token_level_rewards.shape}"
        )
    mask = as_bool_mask(response_mask)
    check_finite(mask, token_level_rewards=token_level_rewards, values=values)
    extra: dict[str, object] = {}
    if values is not None:
        extra["values"] = values.detach()
    if group_ids is not None:
        extra["group_ids"] = group_ids
    if batch_sum is not None:
        extra["batch_sum"] = batch_sum
    with torch.no_grad():
        rewards = zero_masked(token_level_rewards.detach(), mask)
        return ADV_ESTIMATORS.call(name, rewards, mask, **extra, **hparams)
