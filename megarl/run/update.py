"""One optimizer step of a supervised trainer (reward model, SFT, DPO): its micro-batches through
megatron's forward-backward schedule, the finiteness check, the distributed optimizer's step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megarl.models.forward import LossFn, run_schedule
from megarl.run.finite import NonFiniteError, all_finite
from megarl.run.trainable import Trainable


def sum_outputs(outs: Sequence[Mapping[str, torch.Tensor | float]]) -> dict[str, float]:
    """The loss function's metrics summed over this rank's micro-batches (each output already
    weighted by its micro-batch's share: the sum is the rank's batch value)."""
    if not outs:
        return {}
    return {k: float(sum(o[k] for o in outs)) for k in outs[0]}


def optimizer_step(
    model: Trainable,
    micro_batches: list[dict[str, Any]],
    loss_fn: LossFn,
    *,
    prefix: str,
    skip_non_finite: bool,
    lr_setting: str,
) -> dict[str, float]:
    """Forward-backward over ``micro_batches``, then one optimizer and scheduler step; returns
    ``<prefix>/<metric>`` for the loss function's (summed) metrics and ``grad_norm``, ``lr``,
    ``update_ok``, ``skipped_non_finite``. NaN or inf stops the run (or, with
    ``skip_non_finite``, skips the step) before the optimizer touches the weights."""
    model.ddp.zero_grad_buffer()
    model.optimizer.zero_grad()
    outs = run_schedule([model.ddp], micro_batches, loss_fn, forward_only=False)
    if not all_finite(model.ddp, outs):
        model.optimizer.zero_grad()
        if skip_non_finite:
            return {f"{prefix}/skipped_non_finite": 1.0}
        raise NonFiniteError(
            f"NaN or inf in the {prefix} loss or gradients; stopping before the optimizer step "
            f"(the last checkpoint is kept). Lower {lr_setting}, or set trainer.nan_policy=skip "
            "to skip such steps"
        )
    ok, grad_norm, _ = model.optimizer.step()
    model.scheduler.step(increment=1)
    out = {f"{prefix}/{k}": v for k, v in sum_outputs(outs).items()}
    out.update(
        {
            f"{prefix}/grad_norm": float(grad_norm if grad_norm is not None else float("nan")),
            f"{prefix}/lr": float(model.optimizer.param_groups[0]["lr"]),
            f"{prefix}/update_ok": float(bool(ok)),
            f"{prefix}/skipped_non_finite": 0.0,
        }
    )
    return out


def weighted(loss: torch.Tensor, metrics: dict[str, torch.Tensor], weight: float):
    """A micro-batch's loss and metrics scaled by its share of the rank's batch."""
    return loss * weight, {k: v.detach().float() * weight for k, v in metrics.items()}
