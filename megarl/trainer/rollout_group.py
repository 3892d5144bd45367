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

Three parts, one job each: :class:`~megarl.trainer.trainer_link.TrainerLink` (a thread receives
the trainers' control messages, another sends them the leader's generations),
:class:`~megarl.trainer.group_weights.GroupWeights` (a weight push the link announces is
received on the main thread, between generations, at a point every rollout rank agrees on, into
host memory: no NCCL collective ever runs beside vLLM's; the trainers' broadcast therefore waits
for the rollout group's next such point, a batch's end, or with ``rollout.placement.partial`` a
round's) and :class:`RolloutGroup` here, which generates. Loading a version that is due for
validation (``trainer.test_freq``, ``val_before_train``) runs the validation pass on it at once;
such a version is loaded before a newer one is received, so it is never skipped. The trainers
score everything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch.distributed as dist

from megarl.data import PromptItem
from megarl.rollout.async_links import Links
from megarl.rollout.engine_group import share_from_first
from megarl.rollout.rollout_messages import (
    TRAIN,
    VALIDATION,
    Generated,
    Part,
)
from megarl.rollout.rollout_split import (
    rank_engine_slice,
    sample_starts,
)
from megarl.rollout.rollout_types import RolloutEngine, SamplingConfig
from megarl.rollout.trajectory_source import EngineJob, step_of
from megarl.trainer.group_weights import GroupWeights, Stopped
from megarl.trainer.rollout_group_parts import (
    GroupSettings,
    Prompts,
    split_trajectories,
    validation_due,
)
from megarl.trainer.trainer_link import TrainerLink
from megarl.trainer.trajectory_makers import TrajectoryMaker, dataset_row
from megarl.weights.weight_sync import PushInbox, WeightReceiver

T = TypeVar("T")


@dataclass
class RolloutGroup:
    """One rollout rank's generation: its engine, sampling and prompts, with its link to the
    trainers and its weights (:meth:`build` wires the three)."""

    settings: GroupSettings
    rank: int  # in the rollout world
    size: int
    engine: RolloutEngine  # vLLM or HF, over this rank's inference-TP group
    link: TrainerLink
    weights: GroupWeights
    sampling: SamplingConfig
    val_sampling: SamplingConfig
    prompts: Prompts | None  # the leader's
    # how samples are made, as colocated: one reply each (in rollout.placement.partial's
    # rounds), or rollout.env's or rollout.agent's trajectories (an environment's runner on the
    # first rank of each engine)
    trajectories: TrajectoryMaker
    engine_group: dist.ProcessGroup | None = None  # its engine's ranks (multi-turn, infer_tp > 1)
    rollouts: int = 0
    first: int = 0  # the trainers' step when they started
    _rollout_metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        settings: GroupSettings,
        rank: int,
        size: int,
        engine: RolloutEngine,
        links: Links,
        receiver: WeightReceiver,
        sampling: SamplingConfig,
        val_sampling: SamplingConfig,
        prompts: Prompts | None,
        trajectories: TrajectoryMaker,
        world_min: Callable[[list[float]], list[float]] | None = None,
    ) -> RolloutGroup:
        """A rollout rank with its link to the trainers and its weights (``world_min``: the
        rollout world's element-wise minimum; None: an all-reduce over the default group)."""
        inbox = PushInbox()

        def due(version: int) -> bool:  # ``group``: bound below, before any weights arrive
            return validation_due(settings.data, settings.trainer, version, group.first)

        weights = GroupWeights(
            engine,
            receiver,
            size,
            settings.weights_dtype,
            due,
            lambda: group.validate(),
            world_min,
            inbox,
        )
        link = TrainerLink(links, inbox, leader=rank == 0)
        group = cls(
            settings,
            rank,
            size,
            engine,
            link,
            weights,
            sampling,
            val_sampling,
            prompts,
            trajectories,
        )
        return group

    @property
    def leader(self) -> bool:
        return self.rank == 0

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
            self.engine, starts, rollout_index, first, self._share, self.weights.loaded, between
        )
        part = source.run(job)
        assert (part is not None) == first, "a source returns its part on the engine's first rank"
        results = self._gather((engine, part) if part is not None else None)
        if not self.leader:
            return None
        assert items is not None
        parts, step = step_of(results, self.settings.max_env_failures)
        self._rollout_metrics = source.step_metrics(parts)
        return split_trajectories(step, items, n, self.weights.loaded, source.conversations)

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
            self.link.send(Generated(VALIDATION, self.weights.loaded, per_rank, self.rollouts))

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
        message = self.link.verdict()
        if message is None:
            self.weights.inbox.state()  # raises when receiving failed
            raise Stopped
        if (message.step, message.draw) != (step, draw):
            raise RuntimeError(
                f"the trainers judged draw {message.draw} of batch {message.step}; the rollout "
                f"group sent draw {draw} of batch {step} last"
            )
        return message.more

    def _draw(self, step: int, draw: int) -> None:
        """Draw ``draw`` of batch ``step`` generated (the next prompts) and sent."""
        self.weights.times = {}
        self.weights.load(max(self.first, step - self.settings.placement.max_staleness), wait=True)
        items = self.prompts.next() if self.leader and self.prompts else None
        between = None
        if self.settings.placement.partial:

            def between(active: bool) -> int:
                return self.weights.load(0, wait=False)

        t0 = time.perf_counter()
        parts = self._generate(items, self.sampling, between)
        generate_s = time.perf_counter() - t0
        if self.leader and self.prompts is not None:
            assert parts is not None
            metrics = {"generate_s": generate_s, **self.weights.times}
            data_metrics = [t.metrics() for t in self.prompts.train]
            self.link.send(
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
        start = self.link.start()
        if start is None:
            self.weights.inbox.wait_beyond(0)  # raises when receiving failed
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
                self.weights.load(self.weights.loaded + 1, wait=True)
        except Stopped:
            return


__all__ = ["RolloutGroup", "Stopped", "validation_due"]
