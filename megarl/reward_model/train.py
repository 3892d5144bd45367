"""``trainer.kind: reward_model`` (``megarl train-rm``): Bradley-Terry training of a reward model
on preference pairs, in TP/PP/DP with the distributed optimizer; every rank runs it (SPMD).

Per step: this DP rank's ``train_batch_size / dp`` pairs -> micro-batches of whole pairs ->
``-log sigmoid(r_chosen - r_rejected - margin)`` averaged over the rank's pairs (megatron's DDP
then averages over DP ranks) -> one optimizer step. Validation accuracy (share of pairs ranked
right) every ``test_freq`` steps over the whole validation set; checkpoints resume exactly and
export (``megarl convert mcore-to-hf``) as ``*ForSequenceClassification``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megarl import parallel, platform
from megarl.algos import bradley_terry_loss
from megarl.config import RunConfig
from megarl.console import announce
from megarl.data import PreferenceDataset, PreferenceItem
from megarl.metrics import StepMetrics, declare, mean
from megarl.models.dims import ModelDims
from megarl.models.forward import LossFn, broadcast_from_last_stage, run_schedule
from megarl.parallel import ParallelLayout
from megarl.reward_model.pairs import PairMicroBatch, pair_micro_batches
from megarl.rewards.model import last_token_scores
from megarl.run import watchdog
from megarl.run.epochs import EpochBatches
from megarl.run.finite import NonFiniteError, all_finite
from megarl.run.guards import RunGuards
from megarl.run.resume import resume, resume_point, save, save_due
from megarl.run.startup import Startup, start
from megarl.run.steps import announce_steps, log_step, summary, timed
from megarl.run.tracking import Tracker
from megarl.run.trainable import Trainable, build_trainable, model_options, optim_settings

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
    cfg: RunConfig,
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
        max_length=cfg.reward_model.max_length,
        dp_rank=parallel.dp_rank(),
        dp_size=layout.dp,
        seed=cfg.data.seed,
        shuffle=shuffle,
        truncation=cfg.reward_model.truncation,
        setting=setting,
    )


def _micro_batches(
    cfg: RunConfig, items: list[PreferenceItem], pad_id: int
) -> list[dict[str, Any]]:
    mbs = pair_micro_batches(items, cfg.reward_model.micro_batch_size, pad_id, platform.device())
    total = sum(mb.pairs for mb in mbs)
    return [{"input_ids": mb.input_ids, "mb": mb, "weight": mb.pairs / total} for mb in mbs]


def _sum_metrics(outs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Pair-weighted means over this rank's micro-batches (each output is already weighted)."""
    if not outs:
        return {}
    return {k: float(sum(o[k] for o in outs)) for k in outs[0]}


def _update(
    model: Trainable, cfg: RunConfig, items: list[PreferenceItem], pad_id: int, loss_fn: LossFn
) -> dict[str, float]:
    model.ddp.zero_grad_buffer()
    model.optimizer.zero_grad()
    outs = run_schedule(
        [model.ddp], _micro_batches(cfg, items, pad_id), loss_fn, forward_only=False
    )
    if not all_finite(model.ddp, outs):
        model.optimizer.zero_grad()
        if cfg.trainer.nan_policy == "skip":
            return {"rm/skipped_non_finite": 1.0}
        raise NonFiniteError(
            "NaN or inf in the reward-model loss or gradients; stopping before the optimizer "
            "step (the last checkpoint is kept). Lower reward_model.optim.lr, or set "
            "trainer.nan_policy=skip to skip such steps"
        )
    ok, grad_norm, _ = model.optimizer.step()
    model.scheduler.step(increment=1)
    out = {f"rm/{k}": v for k, v in _sum_metrics(outs).items()}
    out.update(
        {
            "rm/grad_norm": float(grad_norm if grad_norm is not None else float("nan")),
            "rm/lr": float(model.optimizer.param_groups[0]["lr"]),
            "rm/update_ok": float(bool(ok)),
            "rm/skipped_non_finite": 0.0,
        }
    )
    return out


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, cfg: RunConfig, dataset: PreferenceDataset, pad_id: int
) -> dict[str, float]:
    """Accuracy, loss and mean gap over one pass of ``dataset``; the same dict on every rank."""
    loss_fn = _pair_loss(cfg.reward_model.margin, pad_id)
    # pairs, correct, loss sum, gap sum
    totals = torch.zeros(4, dtype=torch.float64, device=platform.collective_device())
    for items in dataset:
        outs = run_schedule([model], _micro_batches(cfg, items, pad_id), loss_fn, forward_only=True)
        if outs:
            m = _sum_metrics(outs)
            n = len(items)
            totals += torch.tensor(
                [n, m["accuracy"] * n, m["loss"] * n, m["gap_mean"] * n],
                dtype=torch.float64,
                device=totals.device,
            )
    broadcast_from_last_stage(totals)
    dist.all_reduce(totals, group=parallel.dp_group())
    pairs = max(float(totals[0]), 1.0)
    return {
        "val/rm_accuracy": float(totals[1]) / pairs,
        "val/rm_loss": float(totals[2]) / pairs,
        "val/rm_gap_mean": float(totals[3]) / pairs,
        "val/rm_pairs": float(totals[0]),
    }


def train_reward_model(cfg: RunConfig) -> dict[str, float]:
    """Run a reward-model config to ``trainer.total_steps`` (resuming when asked)."""
    guards = RunGuards()  # preemption signals (honoured at step ends), hang watchdog
    startup = start(cfg, with_rollout=False)
    layout, pad_id = startup.layout, startup.pad_id
    resume_from = resume_point(cfg, {"reward": cfg.model.path})  # before any model is built
    announce(f"reading data: {', '.join(cfg.data.train_files)}")
    train_data = _dataset(
        cfg,
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
        model_options(cfg),
        optim_settings(cfg.reward_model.optim, cfg.trainer.total_steps),
    )
    roles = RewardModelRoles(reward, dims)
    resumed = resume(resume_from, roles, startup.rank)
    if resumed.state:
        train_data.load_state_dict(resumed.state["data"])
    first, history = resumed.step, list(resumed.history)
    tracker = Tracker(cfg, startup.rank, run_id=resumed.tracker_run_id, start_step=first)
    guards.start(cfg.trainer.hang_timeout_s)
    announce_steps(first, cfg.trainer.total_steps)
    validating = bool(cfg.data.val_files and cfg.trainer.test_freq)
    if first == 0 and validating:  # before training
        tracker.log_metrics(_validation(roles, startup), 0)
    batches = EpochBatches(
        train_data, "the training data yields no batch: fewer pairs than data.train_batch_size"
    )
    loss_fn = _pair_loss(cfg.reward_model.margin, pad_id)

    def save_checkpoint(step: int) -> Path:
        data, run_id = train_data.state_dict(), tracker.run_id
        return save(cfg, step, roles, data=data, tracker_run_id=run_id, history=history)

    last: dict[str, float] = {}
    for step in range(first, cfg.trainer.total_steps):
        guards.begin_step(step)
        t0 = time.perf_counter()
        items = batches.next()
        m: StepMetrics = {}
        with timed(m, "update"):
            update = _update(roles.reward, cfg, items, pad_id, loss_fn)
        m.update(declare(update))
        m.update(declare(train_data.metrics()))
        m["perf/step_s"] = mean(time.perf_counter() - t0)
        m["perf/tokens_per_s"] = mean(_tokens(items) * layout.dp / m["perf/step_s"].value)
        last = log_step(tracker, history, m, step, cfg.trainer.total_steps, first)
        if validating and (step + 1) % cfg.trainer.test_freq == 0:
            with watchdog.phase("validation", step):
                val = _validation(roles, startup)
            tracker.log_metrics(val, step + 1)
            last.update(val)
        # a stop signal on any rank (SIGTERM, SIGUSR1, Ctrl-C): checkpoint, then end the run
        if guards.end_step(step, save_due(cfg, step + 1), save_checkpoint):
            break
    guards.close()
    if startup.rank == 0 and history:
        print(summary(history, "rm/accuracy", last), flush=True)
    tracker.close()
    train_data.close()
    return last


def _tokens(items: list[PreferenceItem]) -> int:
    """Tokens of a step's pairs: the prompt twice, both responses."""
    return sum(len(it.prompt_ids) * 2 + len(it.chosen_ids) + len(it.rejected_ids) for it in items)


def _validation(roles: RewardModelRoles, startup: Startup) -> dict[str, float]:
    cfg = startup.cfg
    val_data = _dataset(
        cfg,
        cfg.data.val_files,
        startup.tokenizer,
        cfg.data.val_batch_size,
        startup.layout,
        shuffle=False,
        setting="data.val_files",
    )
    try:
        return evaluate(roles.reward.model, cfg, val_data, startup.pad_id)
    finally:
        val_data.close()
