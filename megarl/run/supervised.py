"""The step loop of the supervised trainers (reward model, SFT, DPO); every rank runs it (SPMD).

A trainer gives its parts (:class:`SupervisedParts`: the trained models, the training data, one
optimizer step on a batch, a validation pass); the loop does the rest the same way for all of
them: start-up, resume (models, optimizer, RNG, data position, metric history, tracker run),
validation before the first step and every ``trainer.test_freq`` steps, checkpoints every
``trainer.save_freq`` steps and at the end (retention as configured), graceful preemption at step
boundaries, the hang watchdog over each phase, and the per-step log.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from megarl.config import RunConfig
from megarl.metrics import StepMetrics, declare, mean
from megarl.run import watchdog
from megarl.run.epochs import EpochBatches
from megarl.run.guards import RunGuards
from megarl.run.resume import resume, resume_point, save, save_due, tracked_start
from megarl.run.startup import Startup, start
from megarl.run.steps import announce_steps, log_step, summary, timed
from megarl.run.tracking import Tracker
from megarl.run.trainable import TrainedModels

T = TypeVar("T")


class TrainingData(Protocol[T]):
    """A resumable dataset of this rank's batches (megarl.data's datasets)."""

    def __iter__(self) -> Iterator[list[T]]: ...
    def state_dict(self) -> dict[str, object]: ...
    def load_state_dict(self, state: dict[str, object]) -> None: ...
    def metrics(self) -> dict[str, float]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class SupervisedParts(Generic[T]):
    """What a supervised trainer hands the loop."""

    models: TrainedModels
    train_data: TrainingData[T]
    step: Callable[[list[T]], dict[str, float]]  # one optimizer step on a batch: its metrics
    validate: Callable[[], dict[str, float]] | None  # a pass over data.val_files: val/* metrics
    tokens: Callable[[list[T]], int]  # tokens a batch puts through the model (perf/tokens_per_s)
    summary_key: str  # the metric whose first and last values the run ends by printing
    empty: str  # the error when the training data yields no batch at all


@dataclass(frozen=True)
class SupervisedTrainer(Generic[T]):
    """A supervised trainer kind: the role it trains (its model read from ``model.path``, the
    checkpoint's checked against it before any model is built) and the set-up of its parts on a
    started rank (the kind's assembly: the one place it reads the whole run config)."""

    role: str
    setup: Callable[[RunConfig, Startup], SupervisedParts[T]]


def train_supervised(cfg: RunConfig, kind: SupervisedTrainer[T]) -> dict[str, float]:
    """Run ``cfg`` with the trainer ``kind`` to ``trainer.total_steps`` (resuming when asked)."""
    guards = RunGuards()  # a preemption signal during set-up is honoured at the first step end
    startup = start(cfg, with_rollout=False)
    resume_from = resume_point(cfg.trainer, {kind.role: cfg.model.path})
    # tracking starts first: its writers (MLflow's process) start beside the models' build
    step, mlflow_run_id = tracked_start(resume_from)
    tracker = Tracker(cfg, startup.rank, mlflow_run_id, start_step=step)
    parts = kind.setup(cfg, startup)
    guards.start(cfg.trainer.hang_timeout_s)
    resumed = resume(resume_from, parts.models, startup.rank)
    if resumed.state:
        parts.train_data.load_state_dict(resumed.state["data"])
    first, history = resumed.step, list(resumed.history)
    announce_steps(first, cfg.trainer.total_steps)
    tracker.begin()
    validate = parts.validate if cfg.data.val_files and cfg.trainer.test_freq else None
    if first == 0 and validate is not None:
        with watchdog.phase("validation", 0):
            tracker.log_metrics(validate(), 0)
    batches = EpochBatches(parts.train_data, parts.empty)

    def save_checkpoint(step: int) -> Path:
        data, run_id = parts.train_data.state_dict(), tracker.mlflow_run_id
        return save(
            cfg.trainer,
            cfg.model.path,
            step,
            parts.models,
            data=data,
            mlflow_run_id=run_id,
            history=history,
        )

    last: dict[str, float] = {}
    for step in range(first, cfg.trainer.total_steps):
        guards.begin_step(step)
        t0 = time.perf_counter()
        with timed("data") as data_time:
            batch = batches.next()
        with timed("update") as update_time:
            updated = declare(parts.step(batch))
        m: StepMetrics = data_time.metrics() | updated | update_time.metrics()
        m.update(declare(parts.train_data.metrics()))
        m["timing/step_s"] = mean(time.perf_counter() - t0)
        m["perf/tokens_per_s"] = mean(
            parts.tokens(batch) * startup.layout.dp / m["timing/step_s"].value
        )
        last = log_step(tracker, history, m, step, cfg.trainer.total_steps, first)
        if validate is not None and (step + 1) % cfg.trainer.test_freq == 0:
            with watchdog.phase("validation", step):
                val = validate()
            tracker.log_metrics(val, step + 1)
            last.update(val)
        # a stop signal on any rank (SIGTERM, SIGUSR1, Ctrl-C): checkpoint, then end the run
        if guards.end_step(step, save_due(cfg.trainer, step + 1), save_checkpoint):
            break
    guards.close()
    if startup.rank == 0 and history:
        print(summary(history, parts.summary_key, last), flush=True)
    tracker.close()
    parts.train_data.close()
    return last
