"""A rollout rank's weights in asynchronous training: the pushes the trainers announced,
received at points every rollout rank agrees on into host memory, and the newest loaded into the
rollout engine (:mod:`megarl.trainer.rollout_group` asks for them between generations).

Receiving runs on the thread that generates, never beside vLLM's collectives: every rank agrees
first on how many announced pushes to take (a collective over the rollout world), then takes
part in each one's broadcasts, so the ranks' collectives come in one order. A version due for
validation is pinned: it is loaded, and validated, before a newer one is received, so it is never
skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl import platform
from megarl.rollout.rollout_types import RolloutEngine
from megarl.weights.weight_sync import PushInbox, Staged, StagedWeights, WeightReceiver


class Stopped(Exception):
    """The trainers are done."""


@dataclass
class GroupWeights:
    """One rollout rank's received and loaded weights."""

    engine: RolloutEngine
    receiver: WeightReceiver
    size: int  # ranks of the rollout world
    dtype: torch.dtype  # the rollout's: received weights are staged in it
    # whether version v is due for validation; and the validation of the version just loaded
    due: Callable[[int], bool]
    validate: Callable[[], None]
    # the rollout world's element-wise minimum (None: dist.all_reduce over the default group)
    world_min: Callable[[list[float]], list[float]] | None = None
    inbox: PushInbox = field(default_factory=PushInbox)  # pushes announced (control thread)
    staged: StagedWeights = field(default_factory=StagedWeights)
    loaded: int = -1
    validated: set[int] = field(default_factory=set)
    times: dict[str, float] = field(default_factory=dict)  # wait_s, load_s, sync_recv_s
    _received: int = 0  # pushes received so far (the same on every rollout rank)

    def load(self, need: int, wait: bool) -> int:
        """Receive what the trainers pushed, then load the newest version (validating it when
        due); with ``wait``, until version ``need`` or newer is loaded. The version loaded.
        Raises :class:`Stopped` when the trainers stopped before it came."""
        t0 = time.perf_counter()
        while True:
            done = self._take_pushes()
            newest = self.staged.version()
            if newest > self.loaded:
                staged = self.staged.get(newest)
                assert staged is not None
                self._load(staged)
                continue
            if self.loaded >= need or not wait:
                break
            if done:
                raise Stopped
            self.inbox.wait_beyond(self._received)
        self._add_time("wait_s", time.perf_counter() - t0)
        return self.loaded

    def _agree(self, values: list[float]) -> list[float]:
        """Element-wise minimum over the rollout world (a collective)."""
        if self.size == 1:
            return values
        if self.world_min is not None:
            return self.world_min(values)
        t = torch.tensor(values, dtype=torch.float64, device=platform.collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t.tolist()

    def _take_pushes(self) -> bool:
        """Receive the pushes every rollout rank has been told of, in their order, into host
        memory (a pinned version is loaded first). Returns whether the trainers are done (every
        rank has seen them stop, so every push is in)."""
        count, closed = self.inbox.state()
        agreed, all_closed = self._agree([float(count), 1.0 if closed else 0.0])
        while self._received < int(agreed):
            waiting = self.staged.get(self.staged.version())
            if waiting is not None and waiting.pinned:
                self._load(waiting)
            version = self.inbox.version(self._received)
            buckets: list[list[tuple[str, torch.Tensor]]] = []
            # staged in host memory (received on the bridge's device)
            stats = self.receiver.receive(
                lambda b, kept=buckets: kept.append(
                    [(n, t.to(device="cpu", dtype=self.dtype)) for n, t in b]
                ),
                version,
            )
            self.staged.put(Staged(version, buckets, stats, pinned=self.due(version)))
            self._received += 1
        return bool(all_closed)

    def _load(self, staged: Staged) -> None:
        t0 = time.perf_counter()
        for bucket in staged.buckets:
            self.engine.update_weights(bucket)
        self.engine.after_weight_update()
        self.staged.consume(staged.version)
        self.loaded = staged.version
        self._add_time("load_s", time.perf_counter() - t0)
        self._add_time("sync_recv_s", staged.stats.seconds)
        if self.due(self.loaded) and self.loaded not in self.validated:
            self.validated.add(self.loaded)
            self.validate()

    def _add_time(self, key: str, seconds: float) -> None:
        self.times[key] = self.times.get(key, 0.0) + seconds


__all__ = ["GroupWeights", "Stopped"]
