"""Where a run's metrics go: small loggers registered by name, chosen with ``trainer.loggers``.

Every logger gets the same stream: the run's settings once (at start), each step's metrics
(already reduced over ranks), and the validation generations as a table. Only global rank 0
builds loggers. The package behind a logger (mlflow, tensorboard, wandb) is imported when that
logger is built, never before, so a run that does not use it needs none of them installed.
"""

from __future__ import annotations

# Each module registers its logger by name; none imports its third-party package at import time.
from megarl.loggers import console, mlflow_logger, tensorboard_logger, wandb_logger  # noqa: F401
from megarl.loggers.base import (
    Logger,
    Progress,
    Row,
    TrackingSettings,
    active_loggers,
    build_loggers,
    check_loggers,
    logger_names,
    register,
)

__all__ = [
    "Logger",
    "Progress",
    "Row",
    "TrackingSettings",
    "active_loggers",
    "build_loggers",
    "check_loggers",
    "logger_names",
    "register",
]
