"""The logger interface, the registry by name, and the checks of ``trainer.loggers``."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megarl.errors import ConfigError

Row = dict[str, str | int | float]


@dataclass(frozen=True)
class TrackingSettings:
    """What a logger needs to know about the run (built from the config by the Tracker)."""

    output_dir: Path
    experiment: str
    run_name: str | None
    params: dict[str, str]
    mlflow_tracking_uri: str | None = None
    wandb_mode: str | None = None
    verbose: bool = False
    resume_step: int = 0  # the step a resumed run continues after; 0 for a fresh run
    run_ids: dict[str, str] = field(default_factory=dict)  # logger name -> its run id, on resume


@dataclass(frozen=True)
class Progress:
    """One training step as the console shows it."""

    step: int  # 1-based
    total: int
    metrics: dict[str, float]
    eta_s: float


class Logger:
    """One destination of the run's metrics. Subclasses override what they support."""

    # Recorded in OUTPUT/tracking_ids.json (MLflow's also in checkpoints): a resumed run continues
    # the same run of the tracking service.
    run_id: str | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_table(self, rows: list[Row], name: str, step: int) -> None:
        pass

    def progress(self, p: Progress) -> None:
        pass

    def close(self) -> None:
        pass


LoggerFactory = Callable[[TrackingSettings], Logger]


@dataclass(frozen=True)
class _Entry:
    factory: LoggerFactory
    package: str | None  # the importable package the logger needs, if any


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, package: str | None = None) -> Callable[[LoggerFactory], LoggerFactory]:
    """Register a logger class (or factory) under ``name`` for ``trainer.loggers``."""

    def deco(factory: LoggerFactory) -> LoggerFactory:
        _REGISTRY[name] = _Entry(factory, package)
        return factory

    return deco


def logger_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a blocked or half-installed package
        return False


def active_loggers(
    names: list[str] | tuple[str, ...], mlflow_tracking_uri: str | None
) -> list[str]:
    """The loggers a run uses, in order, without repeats; ``mlflow_tracking_uri=none`` drops
    MLflow whatever the list says."""
    out: list[str] = []
    for name in names:
        if name not in out:
            out.append(name)
    if (mlflow_tracking_uri or "").strip().lower() == "none":
        out = [n for n in out if n != "mlflow"]
    return out


def check_loggers(names: list[str] | tuple[str, ...], mlflow_tracking_uri: str | None) -> None:
    """Unknown names and loggers whose package is not installed, as errors that name the fix."""
    for name in names:
        if name not in _REGISTRY:
            raise ConfigError(
                f"trainer.loggers: unknown logger {name!r}; choose from {list(_REGISTRY)}"
            )
    for name in active_loggers(names, mlflow_tracking_uri):
        package = _REGISTRY[name].package
        if package and not _installed(package):
            extra = "" if name == "mlflow" else " (pip install 'megarl[loggers]')"
            raise ConfigError(
                f"trainer.loggers includes {name!r} but the {package} package is not installed: "
                f"install it{extra}, or remove {name!r} from trainer.loggers"
                + (" (or set trainer.mlflow_tracking_uri=none)" if name == "mlflow" else "")
            )


def build_loggers(names: list[str], settings: TrackingSettings) -> dict[str, Logger]:
    return {name: _REGISTRY[name].factory(settings) for name in names}
