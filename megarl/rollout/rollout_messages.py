"""What the trainers and the rollout group of asynchronous training tell each other.

Control, trainer rank 0 -> every rollout rank (:class:`Start`, then :class:`Push` before each
weight broadcast, with dynamic sampling a :class:`Draws` verdict after each draw of a step,
:class:`Stop` at the end); generations, rollout leader -> every trainer
(:class:`Generated`: a training batch or a validation pass of every data-parallel rank). A
generation is plain data (:meth:`Generated.to_plain`), so a checkpoint can hold one that was
generated but not trained yet.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from megarl.data import PromptItem
from megarl.envs.trajectory import Trajectory
from megarl.rollout.rollout_batch import RolloutBatch, replies_batch
from megarl.rollout.rollout_types import RolloutOutput

TRAIN, VALIDATION = "train", "val"


@dataclass(frozen=True)
class Start:
    """Where the rollout group begins: the trainers' step (their weights' version), the first
    batch to generate (one later when the checkpoint holds a generated batch), the data position
    before that batch, and the rollout count the request seeds continue from."""

    step: int
    next_batch: int
    data: dict[str, object] | None
    rollouts: int


@dataclass(frozen=True)
class Push:
    """Weights of ``version`` (optimizer steps) follow on the broadcast groups."""

    version: int


@dataclass(frozen=True)
class Draws:
    """Dynamic sampling's verdict on draw ``draw`` of batch ``step``: whether the trainers want
    another draw of prompts for the same step (``more``) or the step is full."""

    step: int
    draw: int
    more: bool


@dataclass(frozen=True)
class Stop:
    """The trainers are done: no more weights, no more batches wanted."""


@dataclass
class Part:
    """One batch of one data-parallel rank: its prompts and their samples (the record the
    colocated engine hands a trainer rank), with the policy version of every response token."""

    items: list[PromptItem]
    batch: RolloutBatch
    versions: list[list[int]]

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> Part:
        items = [PromptItem(**item) for item in plain["items"]]
        versions = [list(v) for v in plain["versions"]]
        if "batch" not in plain:  # a checkpoint written before the typed record
            return cls(items, _batch_of_output(plain, items), versions)
        b = plain["batch"]
        batch = RolloutBatch(
            [Trajectory(**t) for t in b["trajectories"]],
            list(b["prompt_index"]),
            bool(b["conversations"]),
            dict(b["metrics"]),
        )
        return cls(items, batch, versions)


def _batch_of_output(plain: dict[str, Any], items: list[PromptItem]) -> RolloutBatch:
    """The record of a part saved as an engine output (and, for conversations, trajectories)."""
    output = RolloutOutput(**plain["output"])
    if plain.get("trajectories") is not None:
        trajectories = [Trajectory(**t) for t in plain["trajectories"]]
        return RolloutBatch(trajectories, list(output.prompt_index), True)
    return replies_batch([item.input_ids for item in items], output)


@dataclass
class Generated:
    """Batch ``step`` (kind ``train``; ``draw``: its dynamic-sampling draw, 0 first) or the
    validation of version ``step`` (kind ``val``): ``parts[d]`` are data-parallel rank d's
    batches (one for training). ``rollouts``: the rollout count after it; ``data``: the global
    data position after it (training); ``metrics``: the rollout group's view (generation,
    waiting, loading seconds), the same for every rank; ``rollout_metrics``: the multi-turn
    ``rollout/*`` metrics of the whole batch (as the colocated engine gives them)."""

    kind: str
    step: int
    parts: list[list[Part]]
    rollouts: int
    data: dict[str, object] | None = None
    data_metrics: list[dict[str, float]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    draw: int = 0
    rollout_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int, int]:
        return self.kind, self.step, self.draw

    def to_plain(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> Generated:
        parts = [[Part.from_plain(p) for p in rank] for rank in plain["parts"]]
        return cls(**{**plain, "parts": parts})


__all__ = ["TRAIN", "VALIDATION", "Draws", "Generated", "Part", "Push", "Start", "Stop"]
