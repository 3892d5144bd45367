"""Every exported tensor is finite: a NaN or inf weight is never written to a Hugging Face folder
(it would load and generate garbage without a word)."""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.errors import CheckpointError


def check_finite(name: str, tensor: torch.Tensor, ckpt: Path) -> None:
    """Raise CheckpointError naming the tensor when ``tensor`` holds NaN or inf values."""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
        return
    nan = int(torch.isnan(tensor).sum())
    inf = int(torch.isinf(tensor).sum())
    raise CheckpointError(
        f"{ckpt}: tensor {name} holds {nan} NaN and {inf} inf values of {tensor.numel()}; "
        "nothing was exported. The weights were saved broken (or the file was damaged after its "
        "manifest was written): export an earlier checkpoint of the run"
    )
