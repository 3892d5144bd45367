"""Checks that several trainers' validations share: positive sizes, batches that split over the
data-parallel ranks."""

from __future__ import annotations

from megarl.config.schema import ParallelConfig
from megarl.errors import ConfigError


def check_positive(values: dict[str, int]) -> None:
    for key, value in values.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")


def check_dp_split(par: ParallelConfig, world_size: int, batches: dict[str, int]) -> None:
    tp, pp = par.tp, par.pp
    if world_size % (tp * pp):
        raise ConfigError(f"{world_size} processes cannot hold parallel.tp*pp = {tp}*{pp}")
    dp = world_size // (tp * pp)
    for key, value in batches.items():
        if value % dp:
            raise ConfigError(
                f"{key}={value} is not divisible by the {dp} data-parallel ranks "
                f"({world_size} processes / tp*pp {tp * pp}); make it a multiple of {dp}"
            )
