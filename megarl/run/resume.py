"""Where a run continues from: its latest checkpoint (``trainer.resume: auto``) or the start.

The trainer state saved beside the models is plain data written once (rank 0, see
:mod:`megarl.run.trainer_state`); both trainers store ``step``, ``data`` (the global data
position), ``mlflow_run_id`` and ``history`` (the logged metrics of every step so far), the policy
trainer also its KL controller and rollout count. The checkpoint to resume from is found and
checked (same roles, same models) before any model is built: :func:`resume_point`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.config import TrainerConfig
from megarl.console import announce
from megarl.errors import CheckpointError
from megarl.run import checkpointing, trainer_state
from megarl.run.trainable import TrainedModels


@dataclass(frozen=True)
class Resumed:
    """A fresh run (step 0) or what a checkpoint restored: models, optimizers, schedulers and RNG
    are already loaded; the rest of this rank's trainer state is in ``state``."""

    step: int = 0
    history: tuple[dict[str, float], ...] = ()
    mlflow_run_id: str | None = None
    state: Mapping[str, Any] = field(default_factory=dict)


def checkpoint_root(trainer: TrainerConfig) -> Path:
    return Path(trainer.output_dir) / "checkpoints"


def resume_point(trainer: TrainerConfig, model_paths: Mapping[str, str]) -> Path | None:
    """The checkpoint to resume from (the latest, with ``trainer.resume: auto``), checked against
    the roles the run trains (role -> its Hugging Face folder) and the trainer that wrote it
    before any model is built."""
    path = checkpointing.resume_point(trainer, dict(model_paths))
    if path is not None:
        saved = trainer_state.read(path).get("kind", trainer.kind)  # older ones: unchecked
        if saved != trainer.kind:
            raise CheckpointError(
                f"checkpoint {path} was written by a trainer.kind={saved} run and this run is "
                f"trainer.kind={trainer.kind}; use another trainer.output_dir (a trained model "
                "moves between trainers as a Hugging Face folder: megarl convert mcore-to-hf)"
            )
    return path


def tracked_start(path: Path | None) -> tuple[int, str | None]:
    """The step a run resumed from checkpoint ``path`` continues after and its MLflow run id
    ((0, None) for a fresh run): read from the trainer state alone, so that tracking starts
    before the models are built (MLflow's writer then starts beside them)."""
    if path is None:
        return 0, None
    state = trainer_state.read(path)
    run_id = state.get("mlflow_run_id")
    return int(state["step"]), run_id if isinstance(run_id, str) else None


def resume(path: Path | None, models: TrainedModels, rank: int) -> Resumed:
    """Load checkpoint ``path`` (from :func:`resume_point`) into ``models``; a fresh start
    without one."""
    if path is None:
        return Resumed()
    announce(f"loading checkpoint {path}")
    state = checkpointing.load(path, models)
    announce(f"resumed from {path} at step {state['step']}")
    return Resumed(
        step=state["step"],
        history=tuple(state.get("history", [])),
        mlflow_run_id=state.get("mlflow_run_id"),
        state=state,
    )


def save_due(trainer: TrainerConfig, step: int) -> bool:
    """Whether the run saves after ``step`` (1-based): every ``save_freq`` steps and at the end."""
    every = trainer.save_freq
    return bool(every and step % every == 0) or step == trainer.total_steps


def save(
    trainer: TrainerConfig,
    model_path: str,
    step: int,
    models: TrainedModels,
    *,
    data: Mapping[str, object] | None,  # None: an async trainer's data lives in the rollout group
    mlflow_run_id: str | None,
    history: list[dict[str, float]],
    **extra: object,
) -> Path:
    """Checkpoint ``step`` of the policy of ``model_path`` with the trainer state both trainers
    keep (and ``extra`` entries)."""
    state = {
        "step": step,
        "kind": trainer.kind,
        "data": data,
        **extra,
        "mlflow_run_id": mlflow_run_id,
        "history": history,
    }
    return checkpointing.save(
        checkpoint_root(trainer),
        step,
        models,
        model_path,
        state,
        keep_last=trainer.keep_last,
        keep_every=trainer.keep_every,
    )
