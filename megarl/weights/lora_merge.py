"""The actor's weights as the rollout engine must see them when LoRA adapters train: each adapted
linear's shard as ``base + scale * B @ A``, merged on the rank that holds the shard, when the
reshard first reads it, and dropped after its bucket (so merging adds at most one bucket's
tensors to the reshard's memory, and the frozen base is never modified).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megarl.models.loading import unwrap
from megarl.models.lora import LoraAdapter, adapters, global_layer_name
from megarl.weights.reshard_schedule import PlannedTensor

Merge = Callable[[], torch.Tensor]


class MergedLocalTensors(dict):
    """This rank's training shards by plan index (like ``local_spec_tensors``), where reading an
    adapted weight gives it merged with its adapter. ``values()`` and iteration give the base
    views (same shape, dtype and device); :meth:`release` drops the merged tensors made so far."""

    def __init__(self, base: dict[int, torch.Tensor], merges: dict[int, Merge]):
        super().__init__(base)
        self._merges = merges
        self._merged: dict[int, torch.Tensor] = {}

    def __getitem__(self, key: int) -> torch.Tensor:
        merge = self._merges.get(key)
        if merge is None:
            return super().__getitem__(key)
        if key not in self._merged:
            self._merged[key] = merge()
        return self._merged[key]

    def release(self) -> None:
        self._merged.clear()


def _merge(weight: torch.Tensor, adapter: LoraAdapter, part: int | None) -> Merge:
    def run() -> torch.Tensor:
        with torch.no_grad():
            merged = weight + adapter.delta_weight().to(weight.dtype)
        return merged if part is None else merged.chunk(2, dim=0)[part]

    return run


def merged_local_tensors(
    model, base: dict[int, torch.Tensor], specs: Sequence[PlannedTensor], layer_offset: int
) -> MergedLocalTensors:
    """``base`` (``local_spec_tensors``' result) with every adapted weight merged on read."""
    index = {s.name: i for i, s in enumerate(specs)}
    merges: dict[int, Merge] = {}
    for name, adapter in adapters(model):
        weight_name = global_layer_name(f"{name}.weight", layer_offset)
        weight = unwrap(model).get_submodule(name).weight.detach()
        if weight_name in index:
            merges[index[weight_name]] = _merge(weight, adapter, None)
        for part in (0, 1):  # the fused gate/up weight travels as two halves
            i = index.get(f"{weight_name}#{part}")
            if i is not None:
                merges[i] = _merge(weight, adapter, part)
    return MergedLocalTensors(base, merges)
