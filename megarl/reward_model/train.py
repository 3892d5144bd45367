"""``trainer.kind: reward_model`` (``megarl train-rm``): Bradley-Terry training of a reward model
on preference pairs, in TP/PP/DP with the distributed optimizer; every rank runs it (SPMD).

Per step: this DP rank's ``train_batch_size / dp`` pairs -> micro-batches of whole pairs ->
``-log sigmoid(r_chosen - r_rejected - margin)`` averaged over the rank's pairs (megatron's DDP
then averages over DP ranks) -> one optimizer step. Validation accuracy (share of pairs ranked
right) every ``test_freq`` steps over the whole validation set; checkpoints resume exactly and
export (``megarl convert mcore-to-hf``) as ``*ForSequenceClassification``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megarl import parallel, platform
from megarl.algos import bradley_terry_loss
from megarl.config import DataConfig, RewardModelConfig, RunConfig, TrainerConfig
from megarl.console import announce
from megarl.data import PreferenceDataset, PreferenceItem
from megarl.models.dims import ModelDims
from megarl.models.forward import LossFn
from megarl.parallel import ParallelLayout
from megarl.reward_model.pairs import PairMicroBatch, pair_micro_batches
from megarl.rewards.model import last_token_scores
from megarl.run.evaluation import dataset_totals
from megarl.run.startup import Startup
from megarl.run.supervised import SupervisedParts, SupervisedTrainer
from megarl.run.trainable import Trainable, build_trainable, model_options, optim_settings
from megarl.run.update import optimizer_step

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class RewardModelRoles:
    """What the trainer checkpoints: one trainable reward model."""

    reward: Trainable
    dims: ModelDims

    def trainables(self) -> dict[str, Trainable]:
        return {"reward": self.reward}


def _pair_loss(margin: float, pad_id: int | None = None):
    """Bradley-Terry loss of a micro-batch of pairs, each sequence read at its last non-pad token
    (where transformers reads the exported model)."""

    def loss_fn(out: torch.Tensor, batch: dict[str, Any]):
        mb: PairMicroBatch = batch["mb"]
        scores = last_token_scores(out, mb.seq_lens, mb.input_ids, pad_id)
        loss, metrics = bradley_terry_loss(scores[0::2], scores[1::2], margin)
        metrics["loss"] = loss.detach()
        return loss * batch["weight"], {k: v * batch["weight"] for k, v in metrics.items()}

    return loss_fn


def _dataset(
    rm: RewardModelConfig,
    seed: int,
    files: list[str],
    tokenizer: PreTrainedTokenizerBase,
    batch: int,
    layout: ParallelLayout,
    *,
    shuffle: bool,
    setting: str,
) -> PreferenceDataset:
    return PreferenceDataset(
        files,
        tokenizer,
        batch_size_per_rank=batch // layout.dp,
        max_length=rm.max_length,
        dp_rank=parallel.dp_rank(),
        dp_size=layout.dp,
        seed=seed,
        shuffle=shuffle,
        truncation=rm.truncation,
        setting=setting,
    )


def _micro_batches(
    rm: RewardModelConfig, items: list[PreferenceItem], pad_id: int, sums: bool = False
) -> list[dict[str, Any]]:
    """Micro-batches weighted by their share of the batch's pairs (``sums``: by their pairs, so
    that the loss function's metrics add up to sums over pairs)."""
    mbs = pair_micro_batches(items, rm.micro_batch_size, pad_id, platform.device())
    total = 1 if sums else sum(mb.pairs for mb in mbs)
    return [{"input_ids": mb.input_ids, "mb": mb, "weight": mb.pairs / total} for mb in mbs]


def _update(
    model: Trainable,
    rm: RewardModelConfig,
    trainer: TrainerConfig,
    items: list[PreferenceItem],
    pad_id: int,
    loss_fn: LossFn,
) -> dict[str, float]:
    return optimizer_step(
        model,
        _micro_batches(rm, items, pad_id),
        loss_fn,
        prefix="rm",
        skip_non_finite=trainer.nan_policy == "skip",
        lr_setting="reward_model.optim.lr",
    )


def evaluate(
    model: torch.nn.Module, rm: RewardModelConfig, dataset: PreferenceDataset, pad_id: int
) -> dict[str, float]:
    """Accuracy, loss and mean gap over one pass of ``dataset``; the same dict on every rank."""
    totals = dataset_totals(
        model,
        dataset,
        lambda items: _micro_batches(rm, items, pad_id, sums=True),
        _pair_loss(rm.margin, pad_id),
        ("accuracy", "loss", "gap_mean"),
    )
    pairs = max(totals["items"], 1.0)
    return {
        "val/rm_accuracy": totals["accuracy"] / pairs,
        "val/rm_loss": totals["loss"] / pairs,
        "val/rm_gap_mean": totals["gap_mean"] / pairs,
        "val/rm_pairs": totals["items"],
    }


def _setup(cfg: RunConfig, startup: Startup) -> SupervisedParts[PreferenceItem]:
    layout, pad_id = startup.layout, startup.pad_id
    announce(f"reading data: {', '.join(cfg.data.train_files)}")
    train_data = _dataset(
        cfg.reward_model,
        cfg.data.seed,
        cfg.data.train_files,
        startup.tokenizer,
        cfg.data.train_batch_size,
        layout,
        shuffle=cfg.data.shuffle,
        setting="data.train_files",
    )
    announce("building models: reward model")
    reward, dims = build_trainable(
        cfg.model.path,
        layout,
        "reward",
        model_options(cfg.model, cfg.parallel, cfg.actor.lora),
        optim_settings(cfg.reward_model.optim, cfg.trainer.total_steps),
    )
    roles = RewardModelRoles(reward, dims)
    loss_fn = _pair_loss(cfg.reward_model.margin, pad_id)
    return SupervisedParts(
        models=roles,
        train_data=train_data,
        step=lambda items: _update(
            roles.reward, cfg.reward_model, cfg.trainer, items, pad_id, loss_fn
        ),
        validate=lambda: _validation(cfg.reward_model, cfg.data, roles, startup),
        tokens=_tokens,
        summary_key="rm/accuracy",
        empty="the training data yields no batch: fewer pairs than data.train_batch_size",
    )


# A reward model trained on preference pairs (trainer.kind=reward_model).
REWARD_MODEL: SupervisedTrainer[PreferenceItem] = SupervisedTrainer("reward", _setup)


def _tokens(items: list[PreferenceItem]) -> int:
    """Tokens of a step's pairs: the prompt twice, both responses."""
    return sum(len(it.prompt_ids) * 2 + len(it.chosen_ids) + len(it.rejected_ids) for it in items)


def _validation(
    rm: RewardModelConfig, data: DataConfig, roles: RewardModelRoles, startup: Startup
) -> dict[str, float]:
    val_data = _dataset(
        rm,
        data.seed,
        data.val_files,
        startup.tokenizer,
        data.val_batch_size,
        startup.layout,
        shuffle=False,
        setting="data.val_files",
    )
    try:
        return evaluate(roles.reward.model, rm, val_data, startup.pad_id)
    finally:
        val_data.close()
