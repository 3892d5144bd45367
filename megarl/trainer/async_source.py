"""The asynchronous rollout source (``rollout.placement.mode: async``): the rollout group's generations,
through the trainers' link to it (:class:`~megarl.trainer.remote_rollout.RemoteRollout`).

The prompts are read and the samples generated on the rollout ranks; a draw hands the step
what they sent for it. After an optimizer step the new weights are broadcast to them
(:meth:`AsyncSource.publish_weights`), which with ``rollout.placement.max_staleness: 0`` is what the next
batch waits for: synchronous training, sample for sample the colocated run's. No rollout engine
shares the trainers' devices, so no training memory moves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from megarl.data import PromptItem
from megarl.metrics import declare
from megarl.rollout.engine import gpu_memory_metrics
from megarl.rollout.rollout_batch import RolloutBatch
from megarl.run.steps import timed
from megarl.trainer.remote_rollout import RemoteRollout
from megarl.trainer.rollout_source import RolloutState, SourceBatch


@dataclass(frozen=True)
class AsyncSource:
    """The link to the rollout group (which samples as the run's rollout settings say)."""

    remote: RemoteRollout
    has_validation: bool  # data.val_files: the rollout group validates too

    def next_batch(self) -> SourceBatch:
        """The rollout group's next draw for this DP rank (the weights it may come from sent
        first); the weight transfer's figures, the batch's staleness and the rollout group's
        timings, and ``timing/rollout_s`` (handing the received batch over)."""
        items = self.remote.next_batch()
        with timed("rollout") as took:
            metrics = declare(self.remote.to_rollout())
            rollout = self.remote.generate([it.input_ids for it in items])
            # the trainers' GPU memory once the batch is in, as a colocated run logs it
            metrics |= declare(gpu_memory_metrics("after_sleep"))
        return SourceBatch(items, rollout, metrics | took.metrics())

    def validation_batches(self) -> Iterator[tuple[list[PromptItem], RolloutBatch]]:
        """The rollout group's validation of the current weights, batch after batch."""
        self.remote.to_rollout()
        for items in self.remote.validation_batches():
            yield items, self.remote.generate([it.input_ids for it in items])

    def publish_weights(self) -> None:
        """Broadcast the weights of the step just taken to the rollout group (unless no batch
        is left to generate from them)."""
        self.remote.publish()

    def draws_decided(self, more: bool) -> None:
        self.remote.draws_decided(more)

    def data_metrics(self) -> dict[str, float]:
        return self.remote.data_metrics()

    def checkpoint_state(self) -> RolloutState:
        """The batch in flight first (its rollout count is the one to continue from), then the
        data position and rollout count the rollout group reported."""
        in_flight = self.remote.checkpoint_state()
        return RolloutState(self.remote.data_state(), self.remote.rollout_count, in_flight)

    def restore(self, step: int, state: Mapping[str, Any]) -> None:
        self.remote.restore(step, state)

    def close(self) -> None:
        self.remote.close()
