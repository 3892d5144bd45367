"""The reference's and critic's memory (parameters, grads, optimizer states) off the device while
the colocated rollout engine is awake (``ref.param_offload``, ``critic.param_offload``).

Neither model runs during the rollout; their storages go to the host before the engine wakes and
come back after it sleeps (:mod:`megarl.models.offload`: the same tensors, bit for bit). The
actor's own offload (``actor.param_offload``) lives in the hybrid engine, which needs the actor's
weights for the reshard and its logprob scoring inside the rollout phase. Bytes moved and seconds
are the step's metrics ``offload/<role>_bytes``, ``offload/<role>_offload_s``,
``offload/<role>_onload_s``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megarl.config import RunConfig
from megarl.models.offload import Offloaded, model_tensors, offload, onload
from megarl.trainer.roles import Roles


@dataclass
class RoleOffload:
    """Which roles leave the device during the rollout, and their host copies while they are out."""

    # role -> its tensors holding memory, listed when offloaded (Adam's states appear at the
    # first optimizer step)
    tensors: dict[str, Callable[[], list[torch.Tensor]]]
    moved: dict[str, Offloaded] = field(default_factory=dict)

    def offload(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for role, tensors in self.tensors.items():
            if role in self.moved:
                continue
            moved = offload(tensors())
            self.moved[role] = moved
            metrics[f"offload/{role}_bytes"] = float(moved.bytes_moved)
            metrics[f"offload/{role}_offload_s"] = moved.seconds
        return metrics

    def onload(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for role, moved in list(self.moved.items()):
            metrics[f"offload/{role}_onload_s"] = onload(moved)
            del self.moved[role]
        return metrics


def build_role_offload(cfg: RunConfig, roles: Roles) -> RoleOffload:
    """The roles whose ``param_offload`` is on and that this run builds."""
    tensors: dict[str, Callable[[], list[torch.Tensor]]] = {}
    reference, critic = roles.reference, roles.critic
    if cfg.ref.param_offload and reference is not None:
        tensors["ref"] = lambda: model_tensors(reference)
    if cfg.critic.param_offload and critic is not None:
        tensors["critic"] = lambda: model_tensors(critic.ddp, critic.optimizer)
    return RoleOffload(tensors)
