"""The Bradley-Terry loss of a reward model over preference pairs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(
    chosen: Tensor, rejected: Tensor, margin: float | Tensor = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """``mean(-log sigmoid(r_chosen - r_rejected - margin))`` over pairs.

    ``chosen``/``rejected`` are one score per pair, ``[P]``; ``margin`` a float or per-pair
    ``[P]`` (how much better the chosen answer must score). Metrics: ``accuracy`` (share of pairs
    with ``r_chosen > r_rejected``), the mean scores and the mean score gap.
    """
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(
            f"chosen and rejected must both be [pairs]; got {tuple(chosen.shape)} and "
            f"{tuple(rejected.shape)}"
        )
    if chosen.numel() == 0:
        raise ValueError("bradley_terry_loss needs at least one pair")
    if not (torch.isfinite(chosen).all() and torch.isfinite(rejected).all()):
        raise ValueError("NaN or inf in reward-model scores")
    gap = chosen - rejected
    loss = -F.logsigmoid(gap - margin).mean()
    detached = gap.detach()
    return loss, {
        "accuracy": (detached > 0).float().mean(),
        "chosen_mean": chosen.detach().mean(),
        "rejected_mean": rejected.detach().mean(),
        "gap_mean": detached.mean(),
    }
