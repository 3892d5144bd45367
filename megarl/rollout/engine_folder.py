"""What a rollout engine reads of the Hugging Face folder it is built from (its EOS ids, its
tensors' names and shapes), and the check of a weight update against those shapes; shared by both
engines."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from megarl.models.safetensors_io import SafetensorsReader


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (else ``config.json``); empty when none."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of the checkpoint the rollout engine was built from."""

    reader = SafetensorsReader(model_dir)
    return {n: tuple(reader.shape(n)) for n in reader.names()}


def check_weight_update(
    expected_shapes: dict[str, tuple[int, ...]],
    weights: Sequence[tuple[str, torch.Tensor | tuple[int, ...]]],
    model_dir: str,
) -> None:
    """Raise naming the first tensor whose name or shape the rollout model does not have."""
    for name, t in weights:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)
        want = expected_shapes.get(name)
        if want is None:
            raise ValueError(
                f"weight update: tensor {name!r} is not a parameter of the rollout model "
                f"({model_dir}); nothing was loaded"
            )
        if tuple(want) != shape:
            raise ValueError(
                f"weight update: tensor {name!r} has shape {list(shape)} but the rollout "
                f"model expects {list(want)}; nothing was loaded"
            )
