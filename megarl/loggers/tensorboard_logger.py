"""The TensorBoard logger: event files under ``OUTPUT/tensorboard``."""

from __future__ import annotations

import math

from megarl.loggers.base import Logger, Row, TrackingSettings, register


def markdown_table(rows: list[Row]) -> str:
    """Rows as a Markdown table, the form TensorBoard's text plugin renders as a table."""
    columns = list(rows[0])

    def cell(value: object) -> str:
        return " ".join(str(value).split()).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def table_tag(name: str) -> str:
    """``validation/step_000010.json`` -> ``validation/generations`` (the step is the x axis)."""
    folder = name.rpartition("/")[0] or name.rpartition(".")[0]
    return f"{folder}/generations"


@register("tensorboard", package="tensorboard")
class TensorBoardLogger(Logger):
    def __init__(self, settings: TrackingSettings):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = settings.output_dir / "tensorboard"
        # On resume, events logged after the checkpoint's step (by the run that stopped) go.
        purge = settings.resume_step + 1 if settings.resume_step else None
        self._writer = SummaryWriter(str(self.log_dir), purge_step=purge)
        if not settings.resume_step:
            params: list[Row] = [
                {"setting": k, "value": v} for k, v in sorted(settings.params.items())
            ]
            if params:
                self._writer.add_text("config", markdown_table(params), 0)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(float(value)):
                self._writer.add_scalar(key, float(value), step)
        self._writer.flush()

    def log_table(self, rows: list[Row], name: str, step: int) -> None:
        if rows:
            self._writer.add_text(table_tag(name), markdown_table(rows), step)
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()
