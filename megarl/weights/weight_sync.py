"""Asynchronous training's weight transfer: the trainers broadcast the actor after each optimizer
step (:class:`WeightSender`), the rollout ranks receive it whole, in Hugging Face layout
(:class:`WeightReceiver`), into host memory (:class:`StagedWeights`), from where the rollout
engine loads it between requests.

The broadcast runs on each side's main thread, never beside another collective: a trainer sends
right after its optimizer step; a rollout rank learns of a push from its control thread
(:class:`PushInbox`, objects over a gloo bridge: host memory only) and receives it on the thread
that drives vLLM, between two generations, at a point every rollout rank agrees on. vLLM's own
tensor-parallel collectives run on that thread too, so NCCL sees one order of collectives on
every rank (with ``CUDA_DEVICE_MAX_CONNECTIONS=1``, NCCL kernels of two groups issued
concurrently from two threads can each wait for a peer stuck behind the other).

Both sides walk the same :class:`~megarl.weights.broadcast_schedule.BroadcastSchedule`: for each
bucket, each slice is broadcast by the trainer holding it over its broadcast group (the source
and every rollout rank; NCCL on GPUs, gloo on CPU), the rollout ranks assemble whole tensors and
convert the bucket to HF names with the reshard executor's transforms. Staging lets the
trainers send whenever they are done, never waiting for a generation to finish; a newer version
replaces an older one not yet loaded, unless that one is *pinned* (a validation must run on it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from megarl.models.dims import ModelDims
from megarl.weights.broadcast_schedule import BroadcastSchedule
from megarl.weights.execute import ReshardStats, to_hf_tensors
from megarl.world_split import Bridge

_DTYPES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@dataclass
class SyncStats:
    """One weight transfer, as one rank saw it."""

    version: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0

    def as_metrics(self) -> dict[str, float]:
        return {
            "sync/sent_bytes": float(self.sent_bytes),
            "sync/buckets": float(self.buckets),
            "sync/seconds": self.seconds,
        }


class WeightSender:
    """A trainer's part of the broadcast: the slices it is the source of."""

    def __init__(self, plan: BroadcastSchedule, trainer_rank: int, group: Bridge | None) -> None:
        self.plan = plan
        self.rank = trainer_rank
        self.group = group  # this rank's broadcast group (None: it sends nothing)
        if (group is None) != (trainer_rank not in plan.sources()):
            raise ValueError(f"trainer {trainer_rank}: broadcast group and plan disagree")
        self._tp_rank = trainer_rank % plan.tp

    @torch.no_grad()
    def send(self, local: Mapping[int, torch.Tensor], version: int) -> SyncStats:
        """Broadcast this rank's slices (``local``: spec index -> its training shard)."""
        stats = SyncStats(version=version)
        t0 = time.perf_counter()
        for bucket in self.plan.ops:
            for op in bucket:
                if op.src != self.rank:
                    continue
                spec = self.plan.specs[op.slice.tensor]
                shard = local[op.slice.tensor]
                if spec.tp_dim is not None:
                    start = op.slice.start - self._tp_rank * (
                        spec.shape[spec.tp_dim] // self.plan.tp
                    )
                    shard = shard.narrow(spec.tp_dim, start, op.slice.stop - op.slice.start)
                assert self.group is not None
                self.group.broadcast(shard.contiguous(), src=0)
                stats.sent_bytes += op.nbytes
            stats.buckets += 1
        stats.seconds = time.perf_counter() - t0
        return stats


Sink = Callable[[list[tuple[str, torch.Tensor]]], None]


class WeightReceiver:
    """A rollout rank's part: every slice, assembled into whole tensors, bucket by bucket."""

    def __init__(
        self,
        plan: BroadcastSchedule,
        dims: ModelDims,
        groups: Mapping[int, Bridge],
        device: torch.device | str = "cpu",
    ) -> None:
        missing = [s for s in plan.sources() if s not in groups]
        if missing:
            raise ValueError(f"no broadcast group for source trainers {missing}")
        self.plan = plan
        self.dims = dims
        self.groups = dict(groups)
        self.device = torch.device(device)

    @torch.no_grad()
    def receive(self, sink: Sink, version: int) -> SyncStats:
        """Receive every bucket; ``sink`` gets each as ``[(hf_name, tensor)]``."""
        stats = SyncStats(version=version)
        t0 = time.perf_counter()
        specs = self.plan.specs
        for members, bucket in zip(self.plan.buckets, self.plan.ops, strict=True):
            dest = {
                t: torch.empty(specs[t].shape, dtype=_DTYPES[specs[t].itemsize], device=self.device)
                for t in members
            }
            for op in bucket:
                spec, s = specs[op.slice.tensor], op.slice
                target = dest[s.tensor]
                if spec.tp_dim is not None:
                    target = target.narrow(spec.tp_dim, s.start, s.stop - s.start)
                if target.is_contiguous():
                    self.groups[op.src].broadcast(target, src=0)
                else:
                    tmp = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                    self.groups[op.src].broadcast(tmp, src=0)
                    target.copy_(tmp)
                stats.recv_bytes += op.nbytes
            sink(list(to_hf_tensors(specs, members, dest, self.dims, ReshardStats())))
            stats.buckets += 1
        stats.seconds = time.perf_counter() - t0
        return stats


@dataclass
class PushInbox:
    """Weight pushes announced on the control bridge, in their order, for the main thread to
    receive; filled by the control thread, which never touches the weights. ``closed``: the
    trainers are done (every push came before), or the control thread failed (``error``)."""

    _cond: threading.Condition = field(default_factory=threading.Condition)
    _versions: list[int] = field(default_factory=list)
    closed: bool = False
    error: BaseException | None = None

    def add(self, version: int) -> None:
        with self._cond:
            self._versions.append(version)
            self._cond.notify_all()

    def close(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.closed = True
            self.error = self.error or error
            self._cond.notify_all()

    def state(self) -> tuple[int, bool]:
        """(pushes announced so far, closed); raises when the control thread failed."""
        with self._cond:
            self._raise()
            return len(self._versions), self.closed

    def version(self, index: int) -> int:
        with self._cond:
            return self._versions[index]

    def wait_beyond(self, count: int) -> None:
        """Block until more than ``count`` pushes were announced, or no more will be."""
        with self._cond:
            while not self.closed and len(self._versions) <= count:
                self._cond.wait()
            self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError("receiving the trainers' control messages failed") from self.error


@dataclass
class Staged:
    version: int
    buckets: list[list[tuple[str, torch.Tensor]]]
    stats: SyncStats
    pinned: bool = False


@dataclass
class StagedWeights:
    """The newest received weights not yet loaded. ``put`` replaces an unloaded older version
    unless that one is pinned (then it waits until it is consumed: a receiver on the loading
    thread itself loads a pinned version before it receives the next); the loading side reads
    the waiting version (``get``) and consumes it once loaded."""

    _cond: threading.Condition = field(default_factory=threading.Condition)
    _staged: Staged | None = None
    closed: bool = False
    error: BaseException | None = None

    def put(self, staged: Staged) -> None:
        with self._cond:
            while self._staged is not None and self._staged.pinned and not self.closed:
                self._cond.wait()
            self._staged = staged
            self._cond.notify_all()

    def close(self, error: BaseException | None = None) -> None:
        """No more versions will come (the trainers are done, or receiving failed)."""
        with self._cond:
            self.closed = True
            self.error = self.error or error
            self._cond.notify_all()

    def version(self) -> int:
        """The waiting version (-1: none)."""
        with self._cond:
            self._raise()
            return self._staged.version if self._staged is not None else -1

    def get(self, version: int) -> Staged | None:
        """The waiting weights if they are ``version`` (None: another one, or none)."""
        with self._cond:
            staged = self._staged
            return staged if staged is not None and staged.version == version else None

    def consume(self, version: int) -> None:
        """``version`` is loaded: make room for the next."""
        with self._cond:
            if self._staged is not None and self._staged.version == version:
                self._staged = None
                self._cond.notify_all()

    def wait_newer(self, version: int) -> None:
        """Block until a version newer than ``version`` waits, or no more will come."""
        with self._cond:
            while not self.closed and (self._staged is None or self._staged.version <= version):
                self._cond.wait()
            self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError("receiving the trainers' weights failed") from self.error


__all__ = [
    "PushInbox",
    "Staged",
    "StagedWeights",
    "SyncStats",
    "WeightReceiver",
    "WeightSender",
]
