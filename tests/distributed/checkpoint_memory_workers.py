"""Rank-side body of the checkpoint host-memory test (imported by spawned gloo processes): one
training checkpoint save of a trained model, with this rank's resident memory sampled while it
saves."""

from __future__ import annotations

import threading
import time
import types
from pathlib import Path

import psutil


class PeakRSS:
    """The process's peak resident set size (bytes) while the block runs, sampled every 2 ms
    (``peak - start`` is what the block added)."""

    def __enter__(self) -> PeakRSS:
        self._proc = psutil.Process()
        self.start = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _megatron_gather(optimizer, model_sd):
    """megatron's own ``fully_reshardable`` save (the whole TP shard gathered on every rank)."""
    return optimizer.sharded_state_dict(
        model_sd, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
    )


def save_memory_worker(
    rank: int, world: int, model_dir: str, out: str, megatron_gather: bool = False
) -> dict:
    """Build the model at DP ``world``, take one Adam step (so its state exists), then save a
    training checkpoint (with ``megatron_gather``: as megatron builds the optimizer's part);
    what the save added to this rank's resident memory, and this rank's optimizer-state bytes."""
    import torch

    from megarl.models.build import build_model
    from megarl.models.distributed import OptimSettings, wrap_for_training
    from megarl.models.forward import run_schedule
    from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
    from megarl.platform import adapt_megatron_for_cpu
    from megarl.run import checkpointing
    from megarl.run.trainable import Trainable

    adapt_megatron_for_cpu()
    initialize_model_parallel(ParallelLayout.for_world(world))
    model, dims = build_model(model_dir, ParallelLayout.for_world(world), load=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    ddp, optimizer, scheduler = wrap_for_training(model, OptimSettings(lr=1e-3))
    ids = torch.randint(0, dims.vocab_size, (2, 16), generator=gen)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    run_schedule(
        [ddp], [{"input_ids": ids}], lambda out, mb: (out.float().mean(), {}), forward_only=False
    )
    optimizer.step()
    trainable = Trainable(model, ddp, optimizer, scheduler)
    roles = types.SimpleNamespace(trainables=lambda: {"actor": trainable})
    state_bytes = sum(
        v.numel() * v.element_size()
        for s in optimizer.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    if megatron_gather:  # the old save, to measure it beside megarl's
        checkpointing.sharded_optimizer_state = _megatron_gather
    with PeakRSS() as rss:
        checkpointing.save(Path(out), 1, roles, model_dir, {"step": 1, "data": None})
    params = sum(p.numel() for p in model.parameters())
    destroy_model_parallel()
    return {"added": rss.peak - rss.start, "state_bytes": state_bytes, "params": params}
