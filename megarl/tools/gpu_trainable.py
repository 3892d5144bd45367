"""A random-weight model wrapped for training as a megarl actor is (megatron DDP + distributed
Adam, one rank), for the GPU check's measurements of a training step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl import platform
from megarl.algos import vocab_parallel_log_probs
from megarl.models.build import ModelOptions, build_model
from megarl.models.dims import ModelDims
from megarl.models.distributed import OptimSettings, wrap_for_training
from megarl.models.forward import run_schedule
from megarl.parallel import ParallelLayout, initialize_model_parallel


@dataclass
class Trainable:
    """A random-weight megarl model wrapped for training (megatron DDP + distributed Adam) on
    one rank, with one fixed batch of random tokens and its next-token loss."""

    ddp: Any  # megatron's DistributedDataParallel
    optimizer: Any  # a megatron optimizer
    dims: ModelDims
    forward_backward: Callable[[], None]

    def step(self) -> None:
        self.forward_backward()
        self.optimizer.step()


def build_trainable(
    folder: Path, dtype: torch.dtype, batch: int, seq: int, settings: OptimSettings
) -> Trainable:
    """The model of ``folder``'s config in ``dtype``, weights drawn from N(0, 0.02) with a fixed
    seed (the same weights on every call), and a ``batch x seq`` batch of random tokens."""

    layout = ParallelLayout(tp=1, pp=1)
    initialize_model_parallel(layout)
    device = platform.device()
    model, dims = build_model(folder, layout, "actor", ModelOptions(dtype), load=False)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    ddp, optimizer, _ = wrap_for_training(model, settings)
    ids = torch.randint(0, dims.vocab_size, (batch, seq), generator=gen, device=device)

    def loss_fn(logits, mb):
        logp = vocab_parallel_log_probs(
            logits[:, :-1], mb["input_ids"][:, 1:], None, vocab_size=dims.vocab_size
        )
        return -logp.mean(), {}

    def forward_backward() -> None:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        run_schedule([ddp], [{"input_ids": ids}], loss_fn, forward_only=False)

    return Trainable(ddp, optimizer, dims, forward_backward)
