"""The trainer's own part of a checkpoint: one file of plain data, written by rank 0.

It holds what the models' dist checkpoints do not: the step, the rollout counter (request seeds
depend on it), the KL controller, the LR schedulers, Adam's step counts, the data position in
global terms (every data-parallel rank's), the RNG streams and the metric history. Nothing in it
depends on the layout the run was saved at, so a run resumes it at any TP x PP x DP.

Only plain data goes in (dicts, lists, strings, numbers, booleans, None, tensors) and it is read
with ``torch.load(weights_only=True)``: a file that carries anything else (a pickled object, which
could run code when loaded) is refused with a clear error, before any model is built.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from megarl.errors import CheckpointError
from megarl.files import temporary_beside

FILE = "trainer_state.pt"
FORMAT = "megarl.trainer_state/2"
_SCALARS = (bool, int, float, str, type(None))


def check_plain(value: object, where: str = "trainer state") -> None:
    """Raise TypeError naming the first value that is not plain data."""
    if isinstance(value, (_SCALARS, torch.Tensor)):
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}, not str or int")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; the trainer state holds plain data only "
        "(dict, list, str, int, float, bool, None, torch.Tensor)"
    )


def write(folder: Path, state: dict[str, object]) -> Path:
    """Write ``state`` (plain data, see :func:`check_plain`) to ``folder/trainer_state.pt``."""
    record = {"format": FORMAT, **state}
    check_plain(record)
    path = folder / FILE
    with temporary_beside(path) as (f, tmp):
        torch.save(record, f)
    os.replace(tmp, path)
    return path


def read(checkpoint: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint folder; refuses anything but plain data."""
    path = checkpoint / "trainer" / FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: {checkpoint} is not a complete training checkpoint; point "
            f"`latest` in {checkpoint.parent} at a complete one or remove it"
        )
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} holds more than plain data (tensors, numbers, strings): loading it could run "
            f"code, so megarl refuses it ({first}). Resume only from checkpoints written by "
            "megarl that you trust, or start afresh with trainer.overwrite=true (which moves "
            "this run aside)"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(
            f"cannot read {path} ({type(e).__name__}: {e}); the checkpoint is damaged: point "
            f"`latest` in {checkpoint.parent} at an earlier checkpoint"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path} is not a megarl trainer state (format {got!r})")
    try:
        check_plain(state)
    except TypeError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return state
