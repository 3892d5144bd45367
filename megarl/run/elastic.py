"""What a rank knows of elastic recovery: which attempt of the job it belongs to.

The launcher's supervisor (:mod:`megarl.cluster.elastic`) starts every attempt of a job with
``trainer.elastic.max_restarts > 0`` with the record below in the ranks' environment; every step
then logs it, so that the metrics show the restart count and the layout each step ran at.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from megarl.rank_exit import ATTEMPT_ENV

ENV = ATTEMPT_ENV


@dataclass(frozen=True)
class AttemptRecord:
    """One attempt of an elastic job: ``restarts`` so far, its layout, and the steps all restarts
    so far have lost (steps run after the checkpoint each restart went back to)."""

    restarts: int
    world_size: int
    tp: int
    pp: int
    dp: int
    steps_lost: int = 0

    def to_env(self) -> dict[str, str]:
        return {ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls) -> AttemptRecord | None:
        text = os.environ.get(ENV)
        return cls(**json.loads(text)) if text else None


def elastic_metrics() -> dict[str, float]:
    """``elastic/*`` metrics of this attempt (none outside an elastic job)."""
    record = AttemptRecord.from_env()
    if record is None:
        return {}
    return {f"elastic/{k}": float(v) for k, v in asdict(record).items()}
