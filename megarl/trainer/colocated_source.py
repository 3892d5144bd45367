"""The colocated rollout source (``rollout.placement.mode: colocated``): the hybrid engine on the trainers'
own devices, generating from this DP rank's prompts.

Each draw takes the next prompts, moves training memory off the device and the actor's weights
into the engine (:meth:`ColocatedSource.to_rollout`), makes the samples (one of the
:mod:`megarl.trainer.trajectory_makers`), then puts the engine to sleep and brings training
memory back (:meth:`ColocatedSource.to_train`). The weights an optimizer step made reach the
engine at the next draw's reshard, so publishing them is nothing here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from megarl.data import PromptDataset, PromptItem
from megarl.metrics import declare
from megarl.rollout.engine import HybridEngine, gpu_memory_metrics
from megarl.rollout.rollout_batch import RolloutBatch
from megarl.rollout.rollout_types import SamplingConfig
from megarl.run.epochs import EpochBatches
from megarl.run.steps import timed
from megarl.trainer.rollout_offload import ActorMemory, RoleOffload
from megarl.trainer.rollout_source import RolloutState, SourceBatch
from megarl.trainer.trajectory_makers import TrajectoryMaker


@dataclass(frozen=True)
class PolicyData:
    """This DP rank's prompts: training (read epoch after epoch by ``batches``) and validation."""

    train: PromptDataset
    val: PromptDataset | None
    batches: EpochBatches[list[PromptItem]]


@dataclass(frozen=True)
class ColocatedSource:
    """The hybrid engine, the prompts it generates from, how it samples (training and validation)
    and the training memory that leaves the device while it is awake."""

    engine: HybridEngine
    trajectories: TrajectoryMaker
    data: PolicyData
    sampling: SamplingConfig
    val_sampling: SamplingConfig
    # the actor's grads freed, its optimizer state (GPU) or whole model on the host while the
    # engine is awake (megarl.trainer.rollout_offload)
    actor_memory: ActorMemory
    # ref.param_offload / critic.param_offload: those models on the host while the engine is awake
    roles_offload: RoleOffload

    @property
    def has_validation(self) -> bool:
        return self.data.val is not None

    def to_rollout(self) -> dict[str, float]:
        """The reference's and critic's memory (``param_offload``) and the actor's grads and
        optimizer state off the device, the actor's weights resharded into the engine, the engine
        awake (the actor's weights leave too with ``actor.param_offload``, once the reshard has
        read them)."""
        metrics = self.roles_offload.offload()
        metrics |= self.actor_memory.release()
        metrics |= self.engine.to_rollout(before_kv_cache=self.actor_memory.offload_model)
        return metrics

    def to_train(self) -> dict[str, float]:
        """The engine asleep, then every model's training memory back on the device; the GPU
        memory in use then (empty on CPU)."""
        self.engine.to_train()
        metrics = self.actor_memory.restore()
        metrics |= self.roles_offload.onload()
        return metrics | gpu_memory_metrics("after_sleep")

    def next_batch(self) -> SourceBatch:
        """The next prompts and their samples, the engine awake only while it generates; the
        memory moves and ``timing/rollout_s`` (the transitions and generation)."""
        items = self.data.batches.next()
        with timed("rollout") as took:
            moves = declare(self.to_rollout())
            rollout = self.trajectories.make(self.engine, items, self.sampling)
            moves |= declare(self.to_train())
        return SourceBatch(items, rollout, moves | took.metrics())

    def validation_batches(self) -> Iterator[tuple[list[PromptItem], RolloutBatch]]:
        """Every validation batch of this DP rank with its samples, the engine awake throughout."""
        assert self.data.val is not None  # the trainer validates only when has_validation
        self.to_rollout()
        for items in self.data.val:
            yield items, self.trajectories.make(self.engine, items, self.val_sampling)
        self.to_train()

    def publish_weights(self) -> None:
        """Nothing: the next draw reshards the actor's weights into the engine."""

    def draws_decided(self, more: bool) -> None:
        """Nothing: the next draw reads the next prompts."""

    def data_metrics(self) -> dict[str, float]:
        return self.data.train.metrics()

    def checkpoint_state(self) -> RolloutState:
        return RolloutState(self.data.train.state_dict(), self.engine.rollout_count)

    def restore(self, step: int, state: Mapping[str, Any]) -> None:
        """The data position and the rollout count (the seeds follow it) of ``state``."""
        self.data.train.load_state_dict(state["data"])
        self.engine.rollout_count = state["rollouts"]

    def close(self) -> None:
        self.trajectories.close()
