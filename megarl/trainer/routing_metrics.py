"""The step's routing agreement (MoE, routes recorded by the rollout: megarl.models.router_replay):
over every recorded (token, MoE layer) pair of the step's actor forwards on all ranks, the share
whose experts the forward used (``moe/routing_agreement``: 1 under actor.router_replay) and the
share the trainer's own router chose (``moe/router_agreement``, whether replayed or not) equal
the rollout engine's, as sets."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl import platform
from megarl.metrics import StepMetrics, mean
from megarl.models.router_replay import ReplayedRouting, routers, routing_counts
from megarl.trainer.roles import Roles


def routing_metrics(roles: Roles) -> StepMetrics:
    """The step's agreement metrics (a collective over the world), and the counts reset; empty
    when the actor's routers do not replay (no recorded routes). The reference's counts are reset
    too (its forwards replay, the metrics are the actor's)."""
    if not any(isinstance(r.router_replay, ReplayedRouting) for r in routers(roles.actor.model)):
        return {}
    counts = routing_counts(roles.actor.model)
    if roles.reference is not None:
        routing_counts(roles.reference)
    sums = torch.tensor(
        [counts.tokens, counts.router_agrees, counts.used_agrees],
        dtype=torch.float64,
        device=platform.collective_device(),
    )
    dist.all_reduce(sums)
    tokens, router, used = sums.tolist()
    if tokens == 0:
        return {}
    return {
        "moe/routing_agreement": mean(used / tokens),
        "moe/router_agreement": mean(router / tokens),
        "moe/recorded_token_layers": mean(tokens),
    }
