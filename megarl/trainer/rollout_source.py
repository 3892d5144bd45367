"""What the policy trainer sees of the rollout: a :class:`RolloutSource`, whatever generates.

A source hands the step its next batch (prompts and their generated responses), the validation
batches, takes the news of an optimizer step (the weights to publish), hears dynamic sampling's
verdict after each draw, keeps its state in checkpoints and reports what its data filtered. Two
implement it:

- :class:`megarl.trainer.colocated_source.ColocatedSource`: the hybrid engine on the trainers'
  own devices, this DP rank's prompts, the training memory moved off the device around each
  generation, and one of the three ways to make a trajectory (one reply, an environment's turns,
  an agent's runs);
- :class:`megarl.trainer.async_source.AsyncSource`: the rollout group of ``rollout.placement.mode: async``
  (:mod:`megarl.trainer.remote_rollout`); synchronous training is its ``max_staleness=0``.

The trainer (``loop``, ``rollout``, ``validation``, the checkpoint and resume of ``assembly``)
reaches the rollout only through this protocol.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from megarl.data import PromptItem
from megarl.metrics import StepMetrics
from megarl.rollout.rollout_batch import RolloutBatch


@dataclass(frozen=True)
class RolloutState:
    """What a checkpoint keeps of the rollout source."""

    data: Mapping[str, object] | None  # the data position (None: nothing handed out yet)
    rollouts: int  # rollouts generated so far (the request seeds follow it)
    in_flight: dict[str, object] = field(default_factory=dict)  # async: the next batch, if any


@dataclass(frozen=True)
class SourceBatch:
    """One draw of a step: this DP rank's prompts, their responses (or trajectories), and the
    draw's metrics (memory moves or weight transfer, ``timing/rollout_s``)."""

    items: list[PromptItem]
    rollout: RolloutBatch
    metrics: StepMetrics


class RolloutSource(Protocol):
    """The rollout as the policy trainer uses it (every trainer rank calls each method; most are
    collective)."""

    @property
    def has_validation(self) -> bool:
        """Whether the run validates (``data.val_files``)."""
        ...

    def next_batch(self) -> SourceBatch:
        """The next draw of the step: after :meth:`draws_decided` asked for another, the same
        step's next one."""
        ...

    def validation_batches(self) -> Iterator[tuple[list[PromptItem], RolloutBatch]]:
        """This DP rank's validation prompts and their responses, batch after batch, from the
        current weights (the same number of batches on every rank, some maybe empty)."""
        ...

    def publish_weights(self) -> None:
        """The actor took an optimizer step: its weights are the ones to generate from next."""
        ...

    def draws_decided(self, more: bool) -> None:
        """Dynamic sampling's verdict on the draw just handed out (the same on every rank)."""
        ...

    def data_metrics(self) -> dict[str, float]:
        """The training data's counters (prompts it filtered) after the batches handed out."""
        ...

    def checkpoint_state(self) -> RolloutState:
        """What a checkpoint keeps of the rollout (a collective when a batch is in flight)."""
        ...

    def restore(self, step: int, state: Mapping[str, Any]) -> None:
        """Continue from the trainer state of a checkpoint at ``step``."""
        ...

    def close(self) -> None: ...
