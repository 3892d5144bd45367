"""The pure pieces of the asynchronous rollout group (:mod:`megarl.trainer.rollout_group`): when
a weight version is validated, the merged rollout cut back into every trainer data-parallel rank's
part (the split over engines and back is the colocated engine's:
:mod:`megarl.rollout.rollout_split`), the leader's prompts, and the group's settings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megarl.config import DataConfig, PlacementSettings, RewardConfig, TrainerConfig
from megarl.data import PromptDataset, PromptItem
from megarl.data.global_state import merge_rank_states
from megarl.envs.trajectory import Trajectory
from megarl.rollout.rollout_batch import rank_batch
from megarl.rollout.rollout_messages import Part
from megarl.rollout.rollout_split import rank_bounds
from megarl.run.epochs import EpochBatches
from megarl.trainer.assembly import EMPTY_TRAIN_DATA, prompt_dataset


@dataclass(frozen=True)
class GroupSettings:
    """What the rollout group reads of the run's config: its sections, not the whole config."""

    placement: PlacementSettings  # staleness, partial rounds
    max_env_failures: float  # rollout.environment.max_env_failures: the failed-sample guard
    data: DataConfig  # whether there is a validation set (validation_due)
    trainer: TrainerConfig  # total steps, when the trainers validate
    filter_groups: bool  # algorithm.filter_groups: the trainers judge every draw
    weights_dtype: torch.dtype  # the rollout's dtype, which received weights are staged in


def validation_due(data: DataConfig, t: TrainerConfig, version: int, first: int) -> bool:
    """Whether the trainers validate the weights of ``version`` in a run that started at step
    ``first``: before training (``val_before_train``) and every ``test_freq`` steps after."""
    if not data.val_files or version > t.total_steps:
        return False
    if version == first == 0 and t.val_before_train:
        return True
    return bool(t.test_freq) and version > first and version % t.test_freq == 0


def split_trajectories(
    step: Sequence[Trajectory],
    items: Sequence[Sequence[PromptItem]],
    n: int,
    version: int,
    conversations: bool = True,
) -> list[Part]:
    """A batch's trajectories (``sample``: the global index, ``n`` per prompt) back to each
    trainer data-parallel rank, as the colocated engine hands them out
    (:func:`~megarl.rollout.rollout_batch.rank_batch`); each token of the version its trajectory
    recorded, else of ``version``. ``conversations`` False: one reply per sample."""
    parts = []
    for mine, (start, stop) in zip(items, rank_bounds([len(m) for m in items]), strict=True):
        batch = rank_batch(step, start, stop, n, conversations)
        versions = [
            list(t.versions) if t.versions is not None else [version] * len(t.response_ids)
            for t in batch.trajectories
        ]
        parts.append(Part(list(mine), batch, versions))
    return parts


@dataclass
class Prompts:
    """The leader's prompts: every trainer data-parallel rank's training and validation data."""

    train: list[PromptDataset]
    batches: list[EpochBatches[list[PromptItem]]]
    val: list[PromptDataset] | None

    @classmethod
    def build(cls, data: DataConfig, reward: RewardConfig, tokenizer, dp: int) -> Prompts:
        train = [prompt_dataset(data, reward, tokenizer, False, d, dp) for d in range(dp)]
        val = None
        if data.val_files:
            val = [prompt_dataset(data, reward, tokenizer, True, d, dp) for d in range(dp)]
        return cls(train, [EpochBatches(t, EMPTY_TRAIN_DATA) for t in train], val)

    def restore(self, state: dict | None) -> None:
        if state is not None:
            for dataset in self.train:
                dataset.load_state_dict(state)

    def next(self) -> list[list[PromptItem]]:
        return [b.next() for b in self.batches]

    def position(self) -> dict:
        return merge_rank_states([t.state_dict() for t in self.train])

    def validation(self) -> list[list[list[PromptItem]]]:
        """Per validation batch, every rank's prompts (ranks yield equally many batches)."""
        assert self.val is not None
        per_rank = [list(v) for v in self.val]
        return [list(batch) for batch in zip(*per_rank, strict=True)]
