"""The console logger: one progress line per step on stderr, and a line per validation."""

from __future__ import annotations

import sys

from megarl.loggers.base import Logger, Progress, Row, TrackingSettings, register

# The metrics the progress line shows, when present (policy trainer, reward-model trainer, SFT,
# DPO).
SHOWN = (
    "reward/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "critic/vf_loss",
    "rm/loss",
    "rm/accuracy",
    "sft/loss",
    "dpo/loss",
    "dpo/reward_accuracy",
    "timing/step_s",
)
BAR_WIDTH = 20


def progress_line(p: Progress) -> str:
    shown = "  ".join(f"{k.split('/')[-1]}={p.metrics[k]:.4g}" for k in SHOWN if k in p.metrics)
    filled = int(BAR_WIDTH * p.step / max(p.total, 1))
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    return f"[{bar}] step {p.step}/{p.total}  {shown}  eta {p.eta_s:.0f}s"


def _short(text: object, limit: int) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


@register("console")
class ConsoleLogger(Logger):
    def __init__(self, settings: TrackingSettings):
        self.out = sys.stderr

    def progress(self, p: Progress) -> None:
        print(progress_line(p), file=self.out, flush=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # Step metrics are on the progress line; validation results get a line of their own.
        val = {k: v for k, v in metrics.items() if k.startswith("val/")}
        if val:
            shown = "  ".join(f"{k}={v:.4g}" for k, v in sorted(val.items()))
            print(f"validation at step {step}: {shown}", file=self.out, flush=True)

    def log_table(self, rows: list[Row], name: str, step: int) -> None:
        if not rows:
            return
        first = rows[0]
        example = "  ".join(f"{k}={_short(v, 60)}" for k, v in first.items() if k != "step")
        print(
            f"validation at step {step}: {len(rows)} generations, e.g. {example}",
            file=self.out,
            flush=True,
        )
