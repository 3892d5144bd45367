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


def _trained(layout, model_dir: str, steps: int):
    """The folder's model at ``layout`` after ``steps`` Adam steps (so its state exists), the
    same on every rank and at every DP size (every rank takes the same batch)."""
    import torch

    from megarl.models.build import build_model
    from megarl.models.distributed import OptimSettings, wrap_for_training
    from megarl.models.forward import run_schedule
    from megarl.run.trainable import Trainable

    model, dims = build_model(model_dir, layout)  # the folder's random weights, at any layout
    gen = torch.Generator().manual_seed(0)
    ddp, optimizer, scheduler = wrap_for_training(model, OptimSettings(lr=1e-3))
    for _ in range(steps):
        ids = torch.randint(0, dims.vocab_size, (2, 16), generator=gen)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        run_schedule(
            [ddp],
            [{"input_ids": ids}],
            # the mean of the logits at any TP (each rank holds a 1/tp vocabulary slice)
            lambda out, mb: (out.float().sum() / (out.numel() * layout.tp), {}),
            forward_only=False,
        )
        optimizer.step()
    trainable = Trainable(model, ddp, optimizer, scheduler)
    return types.SimpleNamespace(dims=dims, trainables=lambda: {"actor": trainable}), trainable


def _local_states(trainable) -> dict:
    """This rank's distributed-optimizer shard: main weights and Adam moments per owned
    parameter, keyed by parameter name."""
    names = {p: n for n, p in trainable.model.named_parameters()}
    out = {}
    for opt in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer]):
        for gbuf_ranges in opt.gbuf_ranges:
            for buckets in gbuf_ranges.values():
                for bucket in buckets:
                    for param in bucket["param_map"]:
                        states = opt._get_main_param_and_optimizer_states(param)
                        for key in ("param", "exp_avg", "exp_avg_sq"):
                            out[f"{names[param]}.{key}"] = states[key].detach().clone()
    return out


def _max_rel_diff(got: dict, want: dict) -> float:
    """The largest difference of any state element over that tensor's largest magnitude
    (inf where the keys differ)."""
    if got.keys() != want.keys():
        return float("inf")
    return max(
        float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-30)) for k in want
    )


def save_memory_worker(
    rank: int,
    world: int,
    model_dir: str,
    out: str,
    load_from: tuple[str, ...] = (),
    tp2_out: str | None = None,
    megatron_gather: bool = False,
) -> dict:
    """Build the model at DP ``world``, take two Adam steps, then save a training checkpoint to
    ``out`` (with ``megatron_gather``: as megatron builds the optimizer's part); what the save
    added to this rank's resident memory and the model's parameter count. Then each checkpoint of
    ``load_from`` (``out`` itself among them, or ones saved at other layouts) loaded into a fresh
    model at this layout: its optimizer shard's largest relative difference to the trained one.
    With ``tp2_out``, the same steps at TP2 (in these processes) saved there, and saved as
    megatron's gathering save writes it to ``tp2_out + "-megatron"``; ``same``: for each
    checkpoint of ``load_from`` whose ``-megatron`` twin is also there, whether the two loaded
    alike, bit for bit."""
    import torch

    from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
    from megarl.platform import adapt_megatron_for_cpu
    from megarl.run import checkpointing

    adapt_megatron_for_cpu()
    layout = ParallelLayout.for_world(world)
    initialize_model_parallel(layout)
    roles, trainable = _trained(layout, model_dir, steps=2)
    if megatron_gather:  # the old save, to measure it beside megarl's
        checkpointing.sharded_optimizer_state = _megatron_gather
    with PeakRSS() as rss:
        checkpointing.save(Path(out), 1, roles, model_dir, {"step": 1, "data": None})
    params = sum(p.numel() for p in trainable.model.parameters())
    loaded, states = {}, {}
    if load_from:
        trained = _local_states(trainable)
        for root in load_from:
            fresh_roles, fresh = _trained(layout, model_dir, steps=0)
            checkpointing.load(checkpointing.latest(Path(root)), fresh_roles)
            states[root] = _local_states(fresh)
            loaded[root] = _max_rel_diff(states[root], trained)
            del fresh_roles, fresh
    del roles, trainable
    destroy_model_parallel()
    if tp2_out is not None:
        layout = ParallelLayout.for_world(world, tp=2)
        initialize_model_parallel(layout)
        roles, _ = _trained(layout, model_dir, steps=2)
        checkpointing.save(Path(tp2_out), 1, roles, model_dir, {"step": 1, "data": None})
        # and as megatron's own fully_reshardable save writes it, to compare the two
        own, checkpointing.sharded_optimizer_state = (
            checkpointing.sharded_optimizer_state,
            _megatron_gather,
        )
        state = {"step": 1, "data": None}
        checkpointing.save(Path(tp2_out + "-megatron"), 1, roles, model_dir, state)
        checkpointing.sharded_optimizer_state = own
        destroy_model_parallel()
    # pairs of checkpoints (megarl's save, megatron's of the same state) loaded alike, bit for bit
    same = {
        root: states[root].keys() == other.keys()
        and all(torch.equal(states[root][k], other[k]) for k in other)
        for root in states
        for other in [states.get(root + "-megatron")]
        if other is not None
    }
    return {"added": rss.peak - rss.start, "params": params, "loaded": loaded, "same": same}
