"""Slices of Hugging Face tensors as a rollout engine's TP rank loads them (shard-mode resharding).

In ``shard`` mode the reshard hands each rank only what its rollout TP rank loads: for every HF
tensor a :class:`ShardSlice` (where the slice sits in the whole tensor) with the slice itself. The
rollout engines check a bucket's specs against their model before loading any of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSlice:
    """A slice ``[start, start + shape[dim])`` along ``dim`` of the HF tensor ``name``."""

    name: str
    shape: tuple[int, ...]  # the slice's shape
    dim: int | None  # None: the whole tensor (replicated over the rollout's TP ranks)
    start: int = 0

    @property
    def stop(self) -> int:
        return self.start if self.dim is None else self.start + self.shape[self.dim]


WeightShard = tuple[ShardSlice, torch.Tensor]


def check_shards(
    expected_shapes: dict[str, tuple[int, ...]], shards: Sequence[ShardSlice], model_dir: str
) -> None:
    """Raise naming the first slice that is not a slice of a tensor of the rollout model."""
    for s in shards:
        want = expected_shapes.get(s.name)
        if want is None:
            raise ValueError(
                f"weight update: tensor {s.name!r} is not a parameter of the rollout model "
                f"({model_dir}); nothing was loaded"
            )
        want = tuple(want)
        if s.dim is None:
            fits = tuple(s.shape) == want
        else:
            rest = [n for d, n in enumerate(s.shape) if d != s.dim]
            fits = (
                len(s.shape) == len(want)
                and rest == [n for d, n in enumerate(want) if d != s.dim]
                and 0 <= s.start <= s.stop <= want[s.dim]
            )
        if not fits:
            where = "" if s.dim is None else f" at [{s.start}:{s.stop}] of dimension {s.dim}"
            raise ValueError(
                f"weight update: tensor {s.name!r} arrives as a slice of shape {list(s.shape)}"
                f"{where}, which does not fit the rollout model's {list(want)}; nothing was loaded"
            )
