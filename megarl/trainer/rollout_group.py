"""The rollout group of asynchronous training: the program of the last ``parallel.rollout_ranks``
processes of a ``rollout.placement.mode: async`` job (docs/async.md).

They own the rollout engines (``rollout_ranks / infer_tp`` of them, over their own world) and the
prompts (the leader reads every trainer data-parallel rank's shard, as each would in colocated
mode), and generate batch after batch:

1. before batch ``s``, load the newest weights the trainers broadcast, waiting until they are at
   least version ``s - rollout.placement.max_staleness`` (every rollout rank loads the same version at the
   same point: they agree on it first);
2. generate it: prompts spread over the engines, every sample seeded from its global index and
   the rollout count (so samples do not depend on the layout, as colocated); with
   ``rollout.placement.partial`` in rounds of ``rollout.placement.partial_chunk_tokens``, loading new weights between
   rounds; each token keeps its version;
3. send it to the trainers (a thread: generation never waits for them);
4. with dynamic sampling (``algorithm.filter_groups``), draw again from the next prompts while
   the trainers, who score and filter each draw, ask for more (:class:`Draws`), before batch
   ``s + 1``: every draw's prompts and seeds are the colocated run's.

With ``rollout.env`` or ``rollout.agent`` each sample is a multi-turn trajectory, made by the
same :class:`~megarl.rollout.trajectory_source.TrajectorySource` as colocated (an
environment's turn loop, or the agents behind the engine's endpoint): they run on the first rank
of each engine, their results broadcast over the engine's ranks (a tool or an agent runs once per
sample, never once per tensor-parallel rank), seeded from the global sample index and the
rollout count as colocated; the trajectories travel to the trainers with their response masks.

A second thread receives the trainers' control messages (objects over a gloo bridge); a weight
push it announces is received on the main thread, between generations, at a point every rollout
rank agrees on (:meth:`RolloutGroup._take_pushes`), into host memory
(:class:`~megarl.weights.weight_sync.StagedWeights`): no NCCL collective ever runs beside
vLLM's. The trainers' broadcast therefore waits for the rollout group's next such point (a
batch's end, or with ``rollout.placement.partial`` a round's). Loading a version that is due for
validation (``trainer.test_freq``, ``val_before_train``) runs the validation pass on it at once;
such a version is loaded before a newer one is received, so it is never skipped. The trainers
score everything.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from megarl import platform
from megarl.data import PromptItem
from megarl.rollout.async_links import Links
from megarl.rollout.engine_group import share_from_first
from megarl.rollout.rollout_messages import (
    TRAIN,
    VALIDATION,
    Draws,
    Generated,
    Part,
    Push,
    Start,
    Stop,
)
from megarl.rollout.rollout_split import (
    rank_engine_slice,
    sample_starts,
)
from megarl.rollout.rollout_types import RolloutEngine, SamplingConfig
from megarl.rollout.trajectory_source import EngineJob, step_of
from megarl.trainer.rollout_group_parts import (
    GroupSettings,
    Prompts,
    split_trajectories,
    validation_due,
)
from megarl.trainer.trajectory_makers import TrajectoryMaker, dataset_row
from megarl.weights.weight_sync import PushInbox, Staged, StagedWeights, WeightReceiver

T = TypeVar("T")


class Stopped(Exception):
    """The trainers are done."""


@dataclass
class RolloutGroup:
    """One rollout rank's state and what it does."""

    settings: GroupSettings
    rank: int  # in the rollout world
    size: int
    engine: RolloutEngine  # vLLM or HF, over this rank's inference-TP group
    links: Links
    receiver: WeightReceiver
    sampling: SamplingConfig
    val_sampling: SamplingConfig
    prompts: Prompts | None  # the leader's
    # how samples are made, as colocated: one reply each (in rollout.placement.partial's rounds), or
    # rollout.env's or rollout.agent's trajectories (an environment's runner on the first rank
    # of each engine)
    trajectories: TrajectoryMaker
    engine_group: dist.ProcessGroup | None = None  # its engine's ranks (multi-turn, infer_tp > 1)
    staged: StagedWeights = field(default_factory=StagedWeights)
    inbox: PushInbox = field(default_factory=PushInbox)
    # the rollout world's element-wise minimum (None: dist.all_reduce over the default group)
    world_min: Callable[[list[float]], list[float]] | None = None
    _received: int = 0  # pushes received so far (the same on every rollout rank)
    loaded: int = -1
    rollouts: int = 0
    first: int = 0
    validated: set[int] = field(default_factory=set)
    outbox: queue.Queue = field(default_factory=queue.Queue)
    _start: queue.Queue = field(default_factory=queue.Queue)
    _verdicts: queue.Queue = field(default_factory=queue.Queue)  # dynamic sampling's Draws
    _rollout_metrics: dict[str, float] = field(default_factory=dict)
    _times: dict[str, float] = field(default_factory=dict)
    _send_error: list[BaseException] = field(default_factory=list)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- threads -------------------------------------------------------------------------------
    def receive_loop(self) -> None:
        """Control messages from the trainers, until they stop (objects over a gloo bridge:
        host memory only). A push is only announced here: its weights are received on the main
        thread (:meth:`_take_pushes`), never beside vLLM's collectives."""
        try:
            assert self.links.control is not None
            while True:
                message = self.links.control.broadcast_object(src=0)
                if isinstance(message, Start):
                    self.first = message.step
                    self._start.put(message)
                elif isinstance(message, Push):
                    self.inbox.add(message.version)
                elif isinstance(message, Draws):
                    self._verdicts.put(message)
                elif isinstance(message, Stop):
                    self.inbox.close()
                    self._start.put(None)
                    self._verdicts.put(None)
                    return
        except BaseException as e:  # handed to the generating thread
            self.inbox.close(e)
            self._start.put(None)
            self._verdicts.put(None)

    def send_loop(self) -> None:
        """The leader's generations to the trainers, in the order they were made."""
        assert self.links.batches is not None
        while True:
            message = self.outbox.get()
            if message is None:
                return
            try:
                self.links.batches.broadcast_object(message, src=0)
            except BaseException as e:
                self._send_error.append(e)
                return

    def send(self, message: Generated) -> None:
        if self._send_error:
            raise RuntimeError("sending generations to the trainers failed") from self._send_error[
                0
            ]
        if self.leader:
            self.outbox.put(message)

    # -- weights -------------------------------------------------------------------------------
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
        """Receive the weight pushes every rollout rank has been told of, in their order, into
        host memory (a version due for validation is loaded, and validated, before the next
        one is received: it is never skipped). Runs on the main thread between generations:
        every rank agrees first on how many pushes to take (a collective over the rollout
        world), then takes part in each one's broadcasts, so the ranks' collectives come in one
        order. Returns whether the trainers are done (every rank has seen them stop, so every
        push is in)."""
        count, closed = self.inbox.state()
        agreed, all_closed = self._agree([float(count), 1.0 if closed else 0.0])
        dtype = self.settings.weights_dtype
        while self._received < int(agreed):
            waiting = self.staged.get(self.staged.version())
            if waiting is not None and waiting.pinned:
                self._load(waiting)
            version = self.inbox.version(self._received)
            buckets: list[list[tuple[str, torch.Tensor]]] = []
            # staged in host memory (received on the bridge's device)
            stats = self.receiver.receive(
                lambda b, kept=buckets: kept.append(
                    [(n, t.to(device="cpu", dtype=dtype)) for n, t in b]
                ),
                version,
            )
            due = validation_due(self.settings.data, self.settings.trainer, version, self.first)
            self.staged.put(Staged(version, buckets, stats, pinned=due))
            self._received += 1
        return bool(all_closed)

    def load(self, need: int, wait: bool) -> int:
        """Receive what the trainers pushed, then load the newest version (validating it when
        due); with ``wait``, until version ``need`` or newer is loaded. The version loaded."""
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

    def _load(self, staged: Staged) -> None:
        t0 = time.perf_counter()
        for bucket in staged.buckets:
            self.engine.update_weights(bucket)
        self.engine.after_weight_update()
        self.staged.consume(staged.version)
        self.loaded = staged.version
        self._add_time("load_s", time.perf_counter() - t0)
        self._add_time("sync_recv_s", staged.stats.seconds)
        if (
            validation_due(self.settings.data, self.settings.trainer, self.loaded, self.first)
            and self.loaded not in self.validated
        ):
            self.validated.add(self.loaded)
            self.validate()

    def _add_time(self, key: str, seconds: float) -> None:
        self._times[key] = self._times.get(key, 0.0) + seconds

    # -- the split over engines and back (megarl.rollout.rollout_split) --------------------
    def _from_leader(self, value: T) -> T:
        """The leader's ``value`` on every rollout rank."""
        box = [value]
        if self.size > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, value: T) -> list[T]:
        """Every rollout rank's ``value``, in rank order."""
        if self.size == 1:
            return [value]
        results: list = [None] * self.size
        dist.all_gather_object(results, value)
        return results

    def _engine_slice(self, total: int) -> tuple[int, int, int]:
        """This rank's engine and the [lo, hi) of the step's ``total`` prompts it generates."""
        return rank_engine_slice(total, self.size, self.engine.infer_tp, self.rank)

    # -- generation ----------------------------------------------------------------------------
    def _generate(
        self,
        items: list[list[PromptItem]] | None,
        sampling: SamplingConfig,
        between: Callable[[bool], int] | None,
    ) -> list[Part] | None:
        """One batch of every trainer rank's prompts (the leader's ``items``), ``sampling.n``
        each, over the engines (the colocated engine's split, seeds and failure check,
        rollout.environment.max_env_failures); with ``between``, one reply each in partial rounds
        (``between`` loads newer weights between them). The leader gets it back split by
        rank."""
        source = self.trajectories.source(sampling)
        rows = (
            [(dataset_row(it), [int(t) for t in it.input_ids]) for r in items for it in r]
            if items
            else []
        )
        everything = self._from_leader(rows)
        engine, lo, hi = self._engine_slice(len(everything))
        rollout_index = self.rollouts
        self.rollouts += 1
        n = max(1, sampling.n)
        starts = sample_starts(everything, lo, hi, n)
        first = self.rank % self.engine.infer_tp == 0  # its engine's first rank
        job = EngineJob(
            self.engine, starts, rollout_index, first, self._share, self.loaded, between
        )
        part = source.run(job)
        assert (part is not None) == first, "a source returns its part on the engine's first rank"
        results = self._gather((engine, part) if part is not None else None)
        if not self.leader:
            return None
        assert items is not None
        parts, step = step_of(results, self.settings.max_env_failures)
        self._rollout_metrics = source.step_metrics(parts)
        return split_trajectories(step, items, n, self.loaded, source.conversations)

    def _share(self, value: T | None) -> T:
        """The engine's first rank's ``value`` on every rank of this rank's engine."""
        return share_from_first(value, self.engine_group)

    def validate(self) -> None:
        """Validation of the loaded version: every batch of every rank, sent as one message."""
        batches = self.prompts.validation() if self.leader and self.prompts else None
        count = self._from_leader(len(batches) if batches is not None else 0)
        ranks = len(self.prompts.train) if self.prompts is not None else 0
        per_rank: list[list[Part]] = [[] for _ in range(ranks)]
        for b in range(count):
            parts = self._generate(batches[b] if batches else None, self.val_sampling, None)
            for d, part in enumerate(parts or []):
                per_rank[d].append(part)
        if self.leader:
            self.send(Generated(VALIDATION, self.loaded, per_rank, self.rollouts))

    def train_batch(self, step: int) -> None:
        """Batch ``step``: weights within the staleness bound, generated, sent; then dynamic
        sampling's further draws of it while the trainers ask for them."""
        self._draw(step, 0)
        self.extra_draws(step)

    def extra_draws(self, step: int) -> None:
        """With ``algorithm.filter_groups``: after each draw of batch ``step``, the trainers'
        verdict; another draw (the next prompts) while they want more."""
        if not self.settings.filter_groups:
            return
        draw = 0
        while self._verdict(step, draw):
            draw += 1
            self._draw(step, draw)

    def _verdict(self, step: int, draw: int) -> bool:
        message = self._verdicts.get()
        if message is None:
            self.inbox.state()  # raises when receiving failed
            raise Stopped
        if (message.step, message.draw) != (step, draw):
            raise RuntimeError(
                f"the trainers judged draw {message.draw} of batch {message.step}; the rollout "
                f"group sent draw {draw} of batch {step} last"
            )
        return message.more

    def _draw(self, step: int, draw: int) -> None:
        """Draw ``draw`` of batch ``step`` generated (the next prompts) and sent."""
        self._times = {}
        self.load(max(self.first, step - self.settings.placement.max_staleness), wait=True)
        items = self.prompts.next() if self.leader and self.prompts else None
        between = None
        if self.settings.placement.partial:

            def between(active: bool) -> int:
                return self.load(0, wait=False)

        t0 = time.perf_counter()
        parts = self._generate(items, self.sampling, between)
        generate_s = time.perf_counter() - t0
        if self.leader and self.prompts is not None:
            assert parts is not None
            metrics = {"generate_s": generate_s, **self._times}
            data_metrics = [t.metrics() for t in self.prompts.train]
            self.send(
                Generated(
                    TRAIN,
                    step,
                    [[p] for p in parts],
                    self.rollouts,
                    data=self.prompts.position(),
                    data_metrics=data_metrics,
                    metrics=metrics,
                    draw=draw,
                    rollout_metrics=self._rollout_metrics,
                )
            )

    def run(self) -> None:
        """Batches from where the trainers start to the last step, then validations until the
        trainers stop."""
        start = self._start.get()
        if start is None:
            self.inbox.wait_beyond(0)  # raises when receiving failed
            return
        self.first, self.rollouts = start.step, start.rollouts
        if self.prompts is not None:
            self.prompts.restore(start.data)
        try:
            if start.next_batch > start.step:  # the checkpoint held the first draw of its batch
                self.extra_draws(start.step)
            for step in range(start.next_batch, self.settings.trainer.total_steps):
                self.train_batch(step)
            while True:  # validation versions may still come; the trainers end with Stop
                self.load(self.loaded + 1, wait=True)
        except Stopped:
            return


__all__ = ["RolloutGroup", "Stopped", "validation_due"]
