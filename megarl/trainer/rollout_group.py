"""The rollout group of asynchronous training: the program of the last ``parallel.rollout_ranks``
processes of a ``rollout.mode: async`` job (docs/async.md).

They own the rollout engines (``rollout_ranks / infer_tp`` of them, over their own world) and the
prompts (the leader reads every trainer data-parallel rank's shard, as each would in colocated
mode), and generate batch after batch:

1. before batch ``s``, load the newest weights the trainers broadcast, waiting until they are at
   least version ``s - rollout.max_staleness`` (every rollout rank loads the same version at the
   same point: they agree on it first);
2. generate it: prompts spread over the engines, request seeds from the global prompt index and
   the rollout count (so samples do not depend on the layout, as colocated); with
   ``rollout.partial`` in rounds of ``rollout.partial_chunk_tokens``, loading new weights between
   rounds; each token keeps its version;
3. send it to the trainers (a thread: generation never waits for them).

A second thread receives the trainers' control messages and weights into host memory
(:class:`~megarl.hybrid_engine.weight_sync.StagedWeights`). Loading a version that is due for
validation (``trainer.test_freq``, ``val_before_train``) runs the validation pass on it at once;
such a version is pinned until then, so it is never skipped. The trainers score everything.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl import platform
from megarl.config import RunConfig, model_dtype, rollout_dtype
from megarl.config import validate as validate_config
from megarl.data import PromptDataset, PromptItem
from megarl.data.global_state import merge_rank_states
from megarl.dtypes import dtype_from_name
from megarl.hybrid_engine.async_links import Links, make_links, weight_plan
from megarl.hybrid_engine.engine import check_rollout_model, make_rollout
from megarl.hybrid_engine.execute import hf_shapes_of
from megarl.hybrid_engine.rollout_messages import (
    TRAIN,
    VALIDATION,
    Generated,
    Part,
    Push,
    Start,
    Stop,
)
from megarl.hybrid_engine.versioned import VersionedOutput, generate_versioned
from megarl.hybrid_engine.vllm_rollout import RolloutOutput, SamplingConfig, checkpoint_shapes
from megarl.hybrid_engine.weight_sync import Staged, StagedWeights, WeightReceiver
from megarl.models.dims import ModelDims
from megarl.run.epochs import EpochBatches
from megarl.run.startup import layout_for
from megarl.trainer.assembly import (
    EMPTY_TRAIN_DATA,
    engine_config,
    prompt_dataset,
    sampling_configs,
)

ITEMSIZE = {"float32": 4, "bfloat16": 2}


class Stopped(Exception):
    """The trainers are done."""


def validation_due(cfg: RunConfig, version: int, first: int) -> bool:
    """Whether the trainers validate the weights of ``version`` in a run that started at step
    ``first``: before training (``val_before_train``) and every ``test_freq`` steps after."""
    t = cfg.trainer
    if not cfg.data.val_files or version > t.total_steps:
        return False
    if version == first == 0 and t.val_before_train:
        return True
    return bool(t.test_freq) and version > first and version % t.test_freq == 0


def engine_slice(prompts: int, engines: int, engine: int) -> tuple[int, int]:
    """``[lo, hi)`` of the step's prompts that engine ``engine`` of ``engines`` generates."""
    return engine * prompts // engines, (engine + 1) * prompts // engines


def merge_engines(
    results: Sequence[tuple[int, int, VersionedOutput]],
) -> VersionedOutput:
    """The engines' outputs (``(engine, lo, output)`` from every rank; an engine's TP ranks send
    the same) as one, prompt indices global."""
    merged, seen = VersionedOutput(), set()
    for engine, lo, out in sorted(results, key=lambda r: r[0]):
        if engine not in seen:
            seen.add(engine)
            merged.extend(out, index_offset=lo)
    return merged


def split_by_rank(merged: VersionedOutput, items: Sequence[Sequence[PromptItem]]) -> list[Part]:
    """The merged responses back to each trainer data-parallel rank (its prompts ``items[d]``,
    consecutive in the global prompt order)."""
    parts, start = [], 0
    out = merged.output
    for mine in items:
        stop = start + len(mine)
        keep = [k for k, i in enumerate(out.prompt_index) if start <= i < stop]
        parts.append(
            Part(
                list(mine),
                RolloutOutput(
                    prompt_index=[out.prompt_index[k] - start for k in keep],
                    token_ids=[out.token_ids[k] for k in keep],
                    logprobs=[out.logprobs[k] for k in keep],
                    finish_reasons=[out.finish_reasons[k] for k in keep],
                ),
                [merged.versions[k] for k in keep],
            )
        )
        start = stop
    return parts


@dataclass
class Prompts:
    """The leader's prompts: every trainer data-parallel rank's training and validation data."""

    train: list[PromptDataset]
    batches: list[EpochBatches[list[PromptItem]]]
    val: list[PromptDataset] | None

    @classmethod
    def build(cls, cfg: RunConfig, tokenizer, dp: int) -> Prompts:
        train = [prompt_dataset(cfg, tokenizer, False, d, dp) for d in range(dp)]
        val = None
        if cfg.data.val_files:
            val = [prompt_dataset(cfg, tokenizer, True, d, dp) for d in range(dp)]
        return cls(train, [EpochBatches(t, EMPTY_TRAIN_DATA) for t in train], val)

    def restore(self, state: dict | None) -> None:
        if state is not None:
            for dataset in self.train:
                dataset.load_state_dict(state)

    def next(self) -> list[list[PromptItem]]:
        return [b.next() for b in self.batches]

    def position(self) -> dict:
        return merge_rank_states([t.state_dict() for t in self.train])

    def validation(self) -> list[list[list[PromptItem]]]:
        """Per validation batch, every rank's prompts (ranks yield equally many batches)."""
        assert self.val is not None
        per_rank = [list(v) for v in self.val]
        return [list(batch) for batch in zip(*per_rank, strict=True)]


@dataclass
class RolloutGroup:
    """One rollout rank's state and what it does."""

    cfg: RunConfig
    rank: int  # in the rollout world
    size: int
    engine: object  # RolloutEngine (vLLM or HF) over this rank's inference-TP group
    links: Links
    receiver: WeightReceiver
    sampling: SamplingConfig
    val_sampling: SamplingConfig
    prompts: Prompts | None  # the leader's
    staged: StagedWeights = field(default_factory=StagedWeights)
    loaded: int = -1
    rollouts: int = 0
    first: int = 0
    validated: set[int] = field(default_factory=set)
    outbox: queue.Queue = field(default_factory=queue.Queue)
    _start: queue.Queue = field(default_factory=queue.Queue)
    _times: dict[str, float] = field(default_factory=dict)
    _send_error: list[BaseException] = field(default_factory=list)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- threads -------------------------------------------------------------------------------
    def receive_loop(self) -> None:
        """Control messages and weights from the trainers, until they stop."""
        dtype = dtype_from_name(rollout_dtype(self.cfg, platform.device().type == "cuda"))
        try:
            assert self.links.control is not None
            while True:
                message = self.links.control.broadcast_object(src=0)
                if isinstance(message, Start):
                    self.first = message.step
                    self._start.put(message)
                elif isinstance(message, Push):
                    buckets: list[list[tuple[str, torch.Tensor]]] = []
                    # staged in host memory (received on the bridge's device)
                    stats = self.receiver.receive(
                        lambda b, kept=buckets: kept.append(
                            [(n, t.to(device="cpu", dtype=dtype)) for n, t in b]
                        ),
                        message.version,
                    )
                    due = validation_due(self.cfg, message.version, self.first)
                    self.staged.put(Staged(message.version, buckets, stats, pinned=due))
                elif isinstance(message, Stop):
                    self.staged.close()
                    self._start.put(None)
                    return
        except BaseException as e:  # handed to the generating thread
            self.staged.close(e)
            self._start.put(None)

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
        t = torch.tensor(values, dtype=torch.float64, device=platform.collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t.tolist()

    def load(self, need: int, wait: bool) -> int:
        """Load the newest weights every rollout rank has received (validating them when due);
        with ``wait``, until version ``need`` or newer is loaded. The version loaded."""
        t0 = time.perf_counter()
        while True:
            v = self.staged.version()
            closed = self.staged.closed
            lo, neg_hi, open_ = self._agree([float(v), -float(v), 0.0 if closed else 1.0])
            lo, hi = int(lo), int(-neg_hi)
            if lo == hi and lo > self.loaded:
                staged = self.staged.get(lo)
                (have,) = self._agree([1.0 if staged is not None else 0.0])
                if have and staged is not None:
                    self._load(staged)
                    continue
            if self.loaded >= need or not wait:
                break
            if not open_ and lo == hi:
                raise Stopped
            self.staged.wait_newer(self.loaded)
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
        if validation_due(self.cfg, self.loaded, self.first) and self.loaded not in self.validated:
            self.validated.add(self.loaded)
            self.validate()

    def _add_time(self, key: str, seconds: float) -> None:
        self._times[key] = self._times.get(key, 0.0) + seconds

    # -- generation ----------------------------------------------------------------------------
    def _generate(
        self,
        items: list[list[PromptItem]] | None,
        sampling: SamplingConfig,
        between: Callable[[bool], int] | None,
    ) -> list[Part] | None:
        """One batch of every trainer rank's prompts (the leader's ``items``) over the engines;
        the leader gets it back split by rank."""
        flat = [[int(t) for t in it.input_ids] for rank in items for it in rank] if items else []
        box = [flat]
        if self.size > 1:
            dist.broadcast_object_list(box, src=0)
        prompts = box[0]
        itp = self.engine.infer_tp
        engines, engine = self.size // itp, self.rank // itp
        lo, hi = engine_slice(len(prompts), engines, engine)
        seed_offset = lo + self.rollouts * max(1, len(prompts))
        self.rollouts += 1
        chunk = self.cfg.rollout.partial_chunk_tokens if between is not None else None
        out = generate_versioned(
            self.engine, prompts[lo:hi], sampling, seed_offset, self.loaded, chunk, between
        )
        results: list = [None] * self.size
        if self.size > 1:
            dist.all_gather_object(results, (engine, lo, out))
        else:
            results = [(engine, lo, out)]
        if not self.leader:
            return None
        assert items is not None
        return split_by_rank(merge_engines(results), items)

    def validate(self) -> None:
        """Validation of the loaded version: every batch of every rank, sent as one message."""
        batches = self.prompts.validation() if self.leader and self.prompts else None
        count = [len(batches) if batches is not None else 0]
        if self.size > 1:
            dist.broadcast_object_list(count, src=0)
        ranks = len(self.prompts.train) if self.prompts is not None else 0
        per_rank: list[list[Part]] = [[] for _ in range(ranks)]
        for b in range(count[0]):
            parts = self._generate(batches[b] if batches else None, self.val_sampling, None)
            for d, part in enumerate(parts or []):
                per_rank[d].append(part)
        if self.leader:
            self.send(Generated(VALIDATION, self.loaded, per_rank, self.rollouts))

    def train_batch(self, step: int) -> None:
        """Batch ``step``: weights within the staleness bound, generated, sent."""
        self._times = {}
        self.load(max(self.first, step - self.cfg.rollout.max_staleness), wait=True)
        items = self.prompts.next() if self.leader and self.prompts else None
        between = None
        if self.cfg.rollout.partial:

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
                )
            )

    def run(self) -> None:
        """Batches from where the trainers start to the last step, then validations until the
        trainers stop."""
        start = self._start.get()
        if start is None:
            self.staged.wait_newer(-1)  # raises when receiving failed
            return
        self.first, self.rollouts = start.step, start.rollouts
        if self.prompts is not None:
            self.prompts.restore(start.data)
        try:
            for step in range(start.next_batch, self.cfg.trainer.total_steps):
                self.train_batch(step)
            while True:  # validation versions may still come; the trainers end with Stop
                self.load(self.loaded + 1, wait=True)
        except Stopped:
            return


def serve_rollouts(cfg: RunConfig) -> dict[str, float]:
    """The rollout group's program (entry point of a rollout rank in rollout.mode=async)."""
    from transformers import AutoTokenizer

    from megarl.launch import init_split
    from megarl.run.checks import check_inputs
    from megarl.run.preemption import Preemption
    from megarl.run.watchdog import collective_timeout_s

    world = init_split(cfg.parallel.rollout_ranks, collective_timeout_s(cfg.trainer.hang_timeout_s))
    split = world.split
    validate_config(cfg, split.world_size)
    trainers = layout_for(cfg, split.trainers, with_rollout=False)
    check_inputs(cfg, trainers)
    dims = ModelDims.from_pretrained(cfg.model.path)
    cuda = platform.device().type == "cuda"
    plan = weight_plan(dims, trainers, ITEMSIZE[model_dtype(cfg, cuda)])
    expected = checkpoint_shapes(cfg.model.path)
    check_rollout_model(hf_shapes_of(plan.specs, dims), expected, dims.tie_word_embeddings)
    infer_tp = cfg.parallel.infer_tp or cfg.parallel.tp
    if not torch.cuda.is_available() and split.rollout_ranks == infer_tp:
        # one engine, no external launcher: vLLM's CPU build would pin its threads to cores of
        # its choosing, which the trainer processes on this machine use too
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    engine = make_rollout(
        cfg.rollout.backend,
        cfg.model.path,
        infer_tp,
        engine_config(cfg, split.local_rank(world.rank) // infer_tp),
        expected,
    )
    links = make_links(world, plan, platform.distributed_backend())
    receiver = WeightReceiver(plan, dims, links.weights, device=platform.device())
    rank = split.local_rank(world.rank)
    prompts = None
    if rank == 0:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        prompts = Prompts.build(cfg, tokenizer, trainers.dp)
    sampling, val_sampling = sampling_configs(cfg)
    group = RolloutGroup(
        cfg, rank, split.rollout_ranks, engine, links, receiver, sampling, val_sampling, prompts
    )
    threads = [threading.Thread(target=group.receive_loop, name="megarl-weights", daemon=True)]
    if group.leader:
        threads.append(threading.Thread(target=group.send_loop, name="megarl-send", daemon=True))
    # a preemption signal is the trainers' to act on: they save (with the batch in flight) and
    # send Stop, which ends this loop; a second signal stops at once
    preemption = Preemption(world.rank)
    for t in threads:
        t.start()
    try:
        group.run()
    finally:
        preemption.close()
    group.outbox.put(None)
    for t in threads:
        t.join(timeout=60.0)
    return {}


__all__ = ["RolloutGroup", "serve_rollouts", "validation_due"]
