"""The Weights & Biases logger. ``trainer.wandb_mode=offline`` (or ``WANDB_MODE=offline``) writes
the run under ``OUTPUT/wandb/`` without a network; ``wandb sync`` uploads it later."""

from __future__ import annotations

import math
import sys

from megarl.loggers.base import Logger, Row, TrackingSettings, register
from megarl.loggers.tensorboard_logger import table_tag


@register("wandb", package="wandb")
class WandbLogger(Logger):
    def __init__(self, settings: TrackingSettings):
        import wandb

        self._wandb = wandb
        resumed = settings.run_ids.get("wandb")
        self._run = wandb.init(
            project=settings.experiment,
            name=settings.run_name,
            dir=str(settings.output_dir),
            config=dict(settings.params),
            id=resumed,
            resume="allow" if resumed else None,
            # None: WANDB_MODE, else W&B's default (online). A str here: one of the words of the
            # config's trainer.wandb_mode field (loggers sit below the config and take a str).
            mode=settings.wandb_mode,  # type: ignore[arg-type]
            # console="off": W&B would otherwise wrap the process's stdout/stderr.
            settings=wandb.Settings(console="off", silent=not settings.verbose),
        )
        self.run_id = self._run.id
        # A resumed W&B run drops steps below the ones it has (with a warning each): skip them.
        self.next_step = int(getattr(self._run, "step", 0) or 0) if resumed else 0
        if self._run.settings.mode == "offline":
            print(
                f"W&B run {self.run_id} is offline in {self._run.dir}; upload it with "
                f"`wandb sync {settings.output_dir / 'wandb'}`",
                file=sys.stderr,
                flush=True,
            )

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step < self.next_step:
            return
        clean = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))
        }
        self._run.log(clean, step=step)

    def log_table(self, rows: list[Row], name: str, step: int) -> None:
        if rows and step >= self.next_step:
            columns = list(rows[0])
            table = self._wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
            self._run.log({table_tag(name): table}, step=step)

    def close(self) -> None:
        self._run.finish()
