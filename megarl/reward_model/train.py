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
from typing import Any

import torch
import torch.distributed as dist

from megarl.algos import bradley_terry_loss
from megarl.config import RunConfig
from megarl.config import validate as validate_config
from megarl.reward_model.pairs import PairMicroBatch, pair_micro_batches
from megarl.reward_model.scoring import last_token_scores
from megarl.trainer import checkpointing
from megarl.trainer.model_ops import NonFiniteError, all_finite
from megarl.trainer.roles import Trainable, model_options, optim_settings
from megarl.trainer.run_state import check_inputs, reduce_metrics
from megarl.trainer.tracking import Tracker


@dataclass
class RewardModelRoles:
    """What the trainer checkpoints: one trainable reward model."""

    reward: Trainable
    dims: Any

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


def _dataset(cfg: RunConfig, files, tokenizer, batch: int, layout, *, shuffle: bool, setting: str):
    from megatron.core import parallel_state as ps

    from megarl.data import PreferenceDataset

    return PreferenceDataset(
        files,
        tokenizer,
        batch_size_per_rank=batch // layout.dp,
        max_length=cfg.reward_model.max_length,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=layout.dp,
        seed=cfg.data.seed,
        shuffle=shuffle,
        truncation=cfg.reward_model.truncation,
        setting=setting,
    )


def _micro_batches(cfg: RunConfig, items, pad_id: int) -> list[dict[str, Any]]:
    mbs = pair_micro_batches(items, cfg.reward_model.micro_batch_size, pad_id)
    total = sum(mb.pairs for mb in mbs)
    return [{"input_ids": mb.input_ids, "mb": mb, "weight": mb.pairs / total} for mb in mbs]


def _sum_metrics(outs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Pair-weighted means over this rank's micro-batches (each output is already weighted)."""
    if not outs:
        return {}
    return {k: float(sum(o[k] for o in outs)) for k in outs[0]}


def _update(model, cfg: RunConfig, items, pad_id: int, loss_fn) -> dict[str, float]:
    from megarl.models.forward import run_schedule

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
def evaluate(model, cfg: RunConfig, dataset, pad_id: int) -> dict[str, float]:
    """Accuracy, loss and mean gap over one pass of ``dataset``; the same dict on every rank."""
    from megatron.core import parallel_state as ps

    from megarl.models.forward import broadcast_from_last_stage, run_schedule

    loss_fn = _pair_loss(cfg.reward_model.margin, pad_id)
    totals = torch.zeros(4, dtype=torch.float64)  # pairs, correct, loss sum, gap sum
    for items in dataset:
        outs = run_schedule([model], _micro_batches(cfg, items, pad_id), loss_fn, forward_only=True)
        if outs:
            m = _sum_metrics(outs)
            n = len(items)
            totals += torch.tensor(
                [n, m["accuracy"] * n, m["loss"] * n, m["gap_mean"] * n], dtype=torch.float64
            )
    broadcast_from_last_stage(totals)
    dist.all_reduce(totals, group=ps.get_data_parallel_group())
    pairs = max(float(totals[0]), 1.0)
    return {
        "val/rm_accuracy": float(totals[1]) / pairs,
        "val/rm_loss": float(totals[2]) / pairs,
        "val/rm_gap_mean": float(totals[3]) / pairs,
        "val/rm_pairs": float(totals[0]),
    }


def train_reward_model(cfg: RunConfig) -> dict[str, float]:
    """Run a reward-model config to ``trainer.total_steps`` (resuming when asked)."""
    from transformers import AutoTokenizer

    from megarl.data.chat import pad_token_id
    from megarl.launch import init_distributed
    from megarl.models.build import build_model
    from megarl.models.distributed import wrap_for_training
    from megarl.parallel import ParallelLayout, initialize_model_parallel

    _, world = init_distributed()
    p = cfg.parallel
    layout = ParallelLayout.for_world(
        world, tp=p.tp, pp=p.pp, pp_layers=tuple(p.pp_layers) if p.pp_layers else None
    )
    validate_config(cfg, world)
    check_inputs(cfg, layout)
    initialize_model_parallel(layout, seed=cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    pad_id = pad_token_id(tokenizer) or 0
    train_data = _dataset(
        cfg,
        cfg.data.train_files,
        tokenizer,
        cfg.data.train_batch_size,
        layout,
        shuffle=cfg.data.shuffle,
        setting="data.train_files",
    )
    model, dims = build_model(cfg.model.path, layout, "reward", model_options(cfg))
    ddp, optimizer, scheduler = wrap_for_training(
        model, optim_settings(cfg.reward_model.optim, cfg.trainer.total_steps)
    )
    roles = RewardModelRoles(Trainable(model, ddp, optimizer, scheduler), dims)
    start, history, run_id = 0, [], None
    ckpt_root = Path(cfg.trainer.output_dir) / "checkpoints"
    path = checkpointing.latest(ckpt_root) if cfg.trainer.resume == "auto" else None
    if path is not None:
        state = checkpointing.load(path, roles)
        start, history, run_id = state["step"], list(state["history"]), state["mlflow_run_id"]
        train_data.load_state_dict(state["data"])
        if dist.get_rank() == 0:
            print(f"resumed from {path} at step {start}", flush=True)
    tracker = Tracker(cfg, dist.get_rank(), run_id=run_id)
    loss_fn = _pair_loss(cfg.reward_model.margin, pad_id)
    if start == 0 and cfg.data.val_files and cfg.trainer.test_freq:
        tracker.log_metrics(
            _validation(roles, cfg, tokenizer, layout, pad_id), 0
        )  # before training
    batches = iter(train_data)
    last: dict[str, float] = {}
    for step in range(start, cfg.trainer.total_steps):
        t0 = time.perf_counter()
        try:
            items = next(batches)
        except StopIteration:  # next epoch
            batches = iter(train_data)
            items = next(batches)
        m = _update(roles.reward, cfg, items, pad_id, loss_fn)
        m.update(train_data.metrics())
        m["perf/step_s"] = time.perf_counter() - t0
        tokens = sum(
            len(it.prompt_ids) * 2 + len(it.chosen_ids) + len(it.rejected_ids) for it in items
        )
        m["perf/tokens_per_s"] = tokens * layout.dp / m["perf/step_s"]
        last = reduce_metrics(m)
        tracker.log_metrics(last, step + 1)
        tracker.progress(step, cfg.trainer.total_steps, last, start)
        history.append(last)
        if cfg.data.val_files and cfg.trainer.test_freq and (step + 1) % cfg.trainer.test_freq == 0:
            val = _validation(roles, cfg, tokenizer, layout, pad_id)
            tracker.log_metrics(val, step + 1)
            last.update(val)
        final = step + 1 == cfg.trainer.total_steps
        if (cfg.trainer.save_freq and (step + 1) % cfg.trainer.save_freq == 0) or final:
            checkpointing.save(
                ckpt_root,
                step + 1,
                roles,
                cfg.model.path,
                {
                    "step": step + 1,
                    "data": train_data.state_dict(),
                    "mlflow_run_id": tracker.run_id,
                    "history": history,
                },
            )
    if dist.get_rank() == 0 and history:
        first, end = history[0].get("rm/accuracy", float("nan")), last.get("rm/accuracy")
        print(f"rm/accuracy: first step {first:.4f}, last step {end:.4f} over {len(history)} steps")
    tracker.close()
    train_data.close()
    return last


def _validation(roles: RewardModelRoles, cfg: RunConfig, tokenizer, layout, pad_id: int):
    val_data = _dataset(
        cfg,
        cfg.data.val_files,
        tokenizer,
        cfg.data.val_batch_size,
        layout,
        shuffle=False,
        setting="data.val_files",
    )
    try:
        return evaluate(roles.reward.model, cfg, val_data, pad_id)
    finally:
        val_data.close()
