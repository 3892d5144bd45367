"""Training memory off the device while the colocated rollout engine is awake.

- The actor (:class:`ActorMemory`): megatron DDP's grad buffers are freed (they are zeroed at the
  next step anyway) and, on GPUs, Adam's moments go to the host before the reshard; with
  ``actor.param_offload`` its weights and optimizer state follow once the reshard has read them,
  before the engine's KV cache wakes. All of it is back before the actor scores the rollout.
- The reference and critic (:class:`RoleOffload`, ``ref.param_offload``,
  ``critic.param_offload``): neither runs during the rollout; their storages go to the host before
  the engine wakes and come back after it sleeps.

What moves is storage (:mod:`megarl.models.offload`: the same tensors, bit for bit), so nothing
that holds a tensor needs to learn about the move. megatron's hybrid CPU/GPU optimizer
(``actor.optimizer_offload``) keeps part of its state on the host by design; only its device side
moves (:func:`megarl.models.offload.device_side`). Bytes moved and seconds are the step's metrics
``offload/<role>_bytes``, ``offload/<role>_offload_s``, ``offload/<role>_onload_s``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megarl.models.offload import Offloaded, model_tensors, offload, onload, optimizer_moments
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


@dataclass
class ActorMemory:
    """The actor's training-only memory during the rollout: grads freed, optimizer state (GPU)
    and, with ``param_offload``, the whole model on the host."""

    ddp: torch.nn.Module  # megatron DDP: its grad buffers are ``buffers`` (and expert ones)
    optimizer: object | None
    param_offload: bool = False
    # GPU: Adam's moments to the host during the rollout; on the CPU there is nothing to gain
    move_optimizer: bool = field(default_factory=torch.cuda.is_available)
    _grads_freed: bool = False
    _optimizer: Offloaded | None = None
    _model: Offloaded | None = None

    def _grad_buffers(self) -> list:
        return list(getattr(self.ddp, "buffers", [])) + list(
            getattr(self.ddp, "expert_parallel_buffers", [])
        )

    def release(self) -> dict[str, float]:
        """Before the reshard: free the grad buffers and (GPU, without ``param_offload``, which
        moves it with the weights later) move the optimizer's moments to the host."""
        freed = 0
        if not self._grads_freed:
            for buf in self._grad_buffers():
                storage = buf.grad_data.untyped_storage()
                freed += storage.nbytes()
                storage.resize_(0)
            self._grads_freed = bool(self._grad_buffers())
        metrics = {"hybrid/grad_bytes_freed": float(freed)}
        if self.move_optimizer and not self.param_offload and self._optimizer is None:
            self._optimizer = offload(optimizer_moments(self.optimizer))
            metrics["offload/actor_optimizer_bytes"] = float(self._optimizer.bytes_moved)
        return metrics

    def offload_model(self) -> dict[str, float]:
        """With ``param_offload``, once the reshard has read the weights: the actor's weights and
        optimizer state to the host (its grads are freed already)."""
        if not self.param_offload or self._model is not None:
            return {}
        self._model = offload(model_tensors(self.ddp, self.optimizer))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {
            "offload/actor_bytes": float(self._model.bytes_moved),
            "offload/actor_offload_s": self._model.seconds,
        }

    def restore(self) -> dict[str, float]:
        """After the rollout engine sleeps: weights, grad buffers (zeroed) and optimizer state
        back on the device, as they were."""
        metrics: dict[str, float] = {}
        if self._model is not None:
            metrics["offload/actor_onload_s"] = onload(self._model)
            self._model = None
        if self._grads_freed:
            for buf in self._grad_buffers():
                data = buf.grad_data
                data.untyped_storage().resize_(data.numel() * data.element_size())
                data.zero_()
            self._grads_freed = False
        if self._optimizer is not None:
            onload(self._optimizer)
            self._optimizer = None
        return metrics


def build_role_offload(roles: Roles, ref_offload: bool, critic_offload: bool) -> RoleOffload:
    """The roles whose ``param_offload`` is on (``ref.param_offload``, ``critic.param_offload``)
    and that this run builds."""
    tensors: dict[str, Callable[[], list[torch.Tensor]]] = {}
    reference, critic = roles.reference, roles.critic
    if ref_offload and reference is not None:
        tensors["ref"] = lambda: model_tensors(reference)
    if critic_offload and critic is not None:
        tensors["critic"] = lambda: model_tensors(critic.ddp, critic.optimizer)
    return RoleOffload(tensors)


def build_actor_memory(roles: Roles, param_offload: bool) -> ActorMemory:
    """The actor's memory across the rollout (``actor.param_offload``: its weights on the host)."""
    return ActorMemory(roles.actor.ddp, roles.actor.optimizer, param_offload)
