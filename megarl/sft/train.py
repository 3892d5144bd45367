"""``trainer.kind: sft`` (``megarl train-sft``): supervised fine-tuning in TP/PP/DP with the
distributed optimizer; every rank runs it (SPMD).

Per step: this DP rank's ``train_batch_size / dp`` rows -> micro-batches sorted by length (packed
by default) -> the NLL of every trained response token, summed and divided by the trained tokens
of the whole global batch (so the loss is the batch's token mean whatever the micro-batching and
the data-parallel size; megatron's DDP averages the ranks' gradients) -> one optimizer step.
Validation (``val/sft_loss``, ``val/sft_token_accuracy``: the same token means over the whole
validation set) before the first step and every ``trainer.test_freq`` steps. Checkpoints hold the
policy as ``actor``: they resume at any layout and export with ``megarl convert mcore-to-hf``.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl import parallel, platform
from megarl.algos import vocab_parallel_is_argmax
from megarl.config import DataConfig, RunConfig, SFTConfig, TrainerConfig
from megarl.data import SFTDataset, SFTItem
from megarl.models.forward import LossFn
from megarl.models.logprobs import log_probs_at, targets_at
from megarl.run.evaluation import dataset_totals
from megarl.run.sequences import TokenRows, length_groups, token_rows
from megarl.run.startup import Startup
from megarl.run.supervised import SupervisedParts, SupervisedTrainer
from megarl.run.trainable import PolicyModel, build_policy
from megarl.run.update import optimizer_step, weighted
from megarl.trainer.dp_collectives import dp_mean


def sft_loss(vocab_size: int) -> LossFn:
    """The loss of a micro-batch of :class:`TokenRows` on vocab-parallel logits computed at its
    response positions: summed NLL of the trained tokens over ``batch["norm"]`` (the batch's
    trained tokens per data-parallel rank); metrics ``loss``, ``token_accuracy`` (trained tokens
    that are the model's most likely one) and ``tokens`` (trained tokens) on the same scale."""

    def loss_fn(logits_shard: torch.Tensor, batch: dict[str, Any]):
        rows: TokenRows = batch["rows"]
        positions = rows.positions()
        logp, _ = log_probs_at(logits_shard, rows.input_ids, positions, vocab_size)
        mask = rows.loss_mask.to(logp.device)
        nll = -(logp * mask).sum()
        targets = targets_at(rows.input_ids, positions).to(logits_shard.device)
        top1 = vocab_parallel_is_argmax(
            logits_shard, targets, parallel.tp_group_if_split(), vocab_size=vocab_size
        )
        correct = (top1.float() * mask).sum()
        metrics = {"loss": nll, "token_accuracy": correct, "tokens": mask.sum()}
        return weighted(nll, metrics, 1.0 / batch["norm"])

    return loss_fn


def micro_batches(
    s: SFTConfig, items: list[SFTItem], pad_id: int, norm: float
) -> list[dict[str, Any]]:
    """``items`` as micro-batches sorted by length (``sft.micro_batch_size`` rows or
    ``sft.max_tokens_per_micro_batch`` tokens each), each loss divided by ``norm``."""
    lens = [len(it.prompt_ids) + len(it.response_ids) for it in items]
    out = []
    for group in length_groups(lens, s.micro_batch_size, s.max_tokens_per_micro_batch, s.packing):
        rows = token_rows(
            [items[i].prompt_ids for i in group],
            [items[i].response_ids for i in group],
            [items[i].loss_mask for i in group],
            pad_id,
            platform.device(),
        )
        out.append({**rows.schedule_inputs(s.packing), "rows": rows, "norm": norm})
    return out


def _dataset(d: DataConfig, sft: SFTConfig, startup: Startup, *, validation: bool) -> SFTDataset:
    files, batch = (
        (d.val_files, d.val_batch_size) if validation else (d.train_files, d.train_batch_size)
    )
    return SFTDataset(
        files,
        startup.tokenizer,
        batch_size_per_rank=batch // startup.layout.dp,
        max_length=sft.max_length,
        dp_rank=parallel.dp_rank(),
        dp_size=startup.layout.dp,
        seed=d.seed,
        shuffle=d.shuffle and not validation,
        drop_last=not validation,  # validation: every row once
        truncation=sft.truncation,
        setting="data.val_files" if validation else "data.train_files",
    )


def _step(
    policy: PolicyModel, sft: SFTConfig, trainer: TrainerConfig, items: list[SFTItem], pad_id: int
) -> dict[str, float]:
    tokens = dp_mean(float(sum(it.trained_tokens for it in items)))
    out = optimizer_step(
        policy.actor,
        micro_batches(sft, items, pad_id, max(tokens, 1.0)),
        sft_loss(policy.dims.vocab_size),
        prefix="sft",
        skip_non_finite=trainer.nan_policy == "skip",
        lr_setting="sft.optim.lr",
    )
    out.pop("sft/tokens", None)  # tokens / norm: 1 per rank; the count itself instead
    out["sft/tokens"] = tokens * parallel.dp_size()  # trained tokens of the global batch
    return out


def evaluate(
    policy: PolicyModel, sft: SFTConfig, dataset: SFTDataset, pad_id: int
) -> dict[str, float]:
    """``val/sft_loss`` and ``val/sft_token_accuracy`` (token means over the whole dataset),
    ``val/sft_tokens`` and ``val/sft_rows``; the same dict on every rank."""
    totals = dataset_totals(
        policy.actor.model,
        dataset,
        lambda items: micro_batches(sft, items, pad_id, norm=1.0),
        sft_loss(policy.dims.vocab_size),
        ("loss", "token_accuracy", "tokens"),
    )
    tokens = totals["tokens"]
    return {
        "val/sft_loss": totals["loss"] / max(tokens, 1.0),
        "val/sft_token_accuracy": totals["token_accuracy"] / max(tokens, 1.0),
        "val/sft_tokens": tokens,
        "val/sft_rows": totals["items"],
    }


def _setup(cfg: RunConfig, startup: Startup) -> SupervisedParts[SFTItem]:
    pad_id = startup.pad_id
    train_data = _dataset(cfg.data, cfg.sft, startup, validation=False)
    policy = build_policy(
        cfg.model, cfg.parallel, cfg.actor.lora, cfg.trainer, startup.layout, cfg.sft.optim
    )

    def validate() -> dict[str, float]:
        data = _dataset(cfg.data, cfg.sft, startup, validation=True)
        try:
            return evaluate(policy, cfg.sft, data, pad_id)
        finally:
            data.close()

    return SupervisedParts(
        models=policy,
        train_data=train_data,
        step=lambda items: _step(policy, cfg.sft, cfg.trainer, items, pad_id),
        validate=validate,
        tokens=lambda items: sum(len(it.prompt_ids) + len(it.response_ids) for it in items),
        summary_key="sft/loss",
        empty="the training data yields no batch: fewer rows than data.train_batch_size",
    )


# Supervised fine-tuning of the policy (trainer.kind=sft).
SFT: SupervisedTrainer[SFTItem] = SupervisedTrainer("actor", _setup)
