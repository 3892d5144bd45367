"""The asynchronous rollout group issues its collectives in one order on every rank, all from the
thread that drives the rollout engine: the weight broadcasts never run beside vLLM's.

Two rollout ranks (one engine over both, as vLLM TP2) and two trainers run as threads over a
recording stand-in for every process group: the rollout world's agreement (the real code's
all-reduce), the engine's tensor-parallel collective in each generation, and each trainer's
weight-broadcast group. Each collective is a rendezvous of its members (as NCCL's are): members
that issue collectives in different orders wait on each other until the rendezvous times out.
The control messages reach each rollout rank late by a derandomised random delay, and the
trainers push at random times, so the ranks learn of a push at different points of their work.
Recorded per rank: which group, from which thread."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable

import pytest
import torch

from megarl.config import load_config
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.rollout.async_links import Links, weight_schedule
from megarl.rollout.rollout_messages import Push, Start, Stop
from megarl.rollout.rollout_types import RolloutOutput, SamplingConfig
from megarl.trainer.rollout_group import RolloutGroup, Stopped
from megarl.trainer.trajectory_makers import OneReply
from megarl.weights.weight_sync import WeightReceiver, WeightSender
from tests.async_settings import group_settings

ROLLOUT_RANKS, STEPS, STALENESS = 2, 5, 1
TIMEOUT = 20.0  # seconds a rendezvous waits for its members before the test fails

DIMS = ModelDims.from_hf_config(
    {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
)


class Log:
    """Each rollout rank's collectives: (group, thread name), in the order issued."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_rank: dict[int, list[tuple[str, str]]] = {r: [] for r in range(ROLLOUT_RANKS)}

    def record(self, rank: int, group: str) -> None:
        with self.lock:
            self.by_rank[rank].append((group, threading.current_thread().name))


class Rendezvous:
    """One process group: a collective returns once every member has issued its next one."""

    def __init__(self, name: str, members: int) -> None:
        self.name = name
        self.barrier = threading.Barrier(members, timeout=TIMEOUT)

    def meet(self) -> None:
        self.barrier.wait()


class RecordingBridge:
    """A member's end of a weight-broadcast group (the Bridge interface the sender and the
    receiver use); rollout ranks record what they issue."""

    def __init__(self, group: Rendezvous, log: Log, rollout_rank: int | None) -> None:
        self.group, self.log, self.rank = group, log, rollout_rank

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.rank is not None:
            self.log.record(self.rank, self.group.name)
        self.group.meet()


class ControlBridge:
    """A rollout rank's end of the control bridge: trainer 0's messages, each late by a random
    delay (derandomised: the same delays on every run of a seed)."""

    def __init__(self, rng: random.Random) -> None:
        self.messages: queue.Queue = queue.Queue()
        self.rng = rng

    def broadcast_object(self, obj: object = None, src: int = 0) -> object:
        message = self.messages.get(timeout=TIMEOUT)
        time.sleep(self.rng.uniform(0.0, 0.02))
        return message


class RecordingEngine:
    """The rollout engine of one rank: each generation is one tensor-parallel collective over
    both ranks (as vLLM TP2's all-reduces)."""

    infer_tp = ROLLOUT_RANKS
    backend = "fake"

    def __init__(self, tp: Rendezvous, log: Log, rank: int) -> None:
        self.tp, self.log, self.rank = tp, log, rank
        self.loaded: list[int] = []

    def generate(self, prompts, sampling, seed_offset=0, *, seeds=None, max_new_tokens=None):
        self.log.record(self.rank, self.tp.name)
        self.tp.meet()
        return RolloutOutput()

    def update_weights(self, weights) -> None:
        assert all(t.device.type == "cpu" for _, t in weights)

    def after_weight_update(self) -> None:
        pass


def _world_min(log: Log, rank: int, world: Rendezvous, slots: dict) -> Callable:
    def world_min(values: list[float]) -> list[float]:
        log.record(rank, world.name)
        slots[rank] = list(values)
        world.meet()
        out = [
            min(column) for column in zip(*(slots[r] for r in range(ROLLOUT_RANKS)), strict=True)
        ]
        world.meet()  # everyone has read the slots before the next agreement writes them
        return out

    return world_min


def _run(seed: int) -> tuple[Log, list[RolloutGroup], list[BaseException]]:
    rng = random.Random(seed)
    cfg = load_config(
        "configs/quickstart_cpu.yaml",
        ["model.path=/models/x", "data.train_files=[a.parquet]", "data.val_files=[]"],
    )
    trainers = ParallelLayout(tp=1, pp=1, dp=2)
    plan = weight_schedule(DIMS, trainers, itemsize=4, bucket_bytes=4096)
    sources = plan.sources()
    assert sources == [0, 1]  # both trainers send part of every push
    log = Log()
    weights = {src: Rendezvous(f"weights/{src}", 1 + ROLLOUT_RANKS) for src in sources}
    tp = Rendezvous("vllm-tp", ROLLOUT_RANKS)
    world = Rendezvous("rollout-world", ROLLOUT_RANKS)
    slots: dict[int, list[float]] = {}
    groups = []
    for rank in range(ROLLOUT_RANKS):
        bridges = {src: RecordingBridge(weights[src], log, rank) for src in sources}
        group = RolloutGroup.build(
            group_settings(cfg),
            rank,
            ROLLOUT_RANKS,
            RecordingEngine(tp, log, rank),
            Links(ControlBridge(random.Random(seed * 10 + rank)), None, {}),  # type: ignore[arg-type]
            WeightReceiver(plan, DIMS, bridges),  # type: ignore[arg-type]
            SamplingConfig(),
            SamplingConfig(),
            None,
            OneReply(),
            world_min=_world_min(log, rank, world, slots),
        )
        groups.append(group)
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:
                errors.append(e)

        return run

    def rollout_main(group: RolloutGroup) -> None:
        for step in range(STEPS):
            group.weights.load(max(0, step - STALENESS), wait=True)
            for _ in range(2):  # two generations a batch: rounds of a partial rollout
                group.engine.generate([[1]], group.sampling)
                group.weights.load(0, wait=False)  # a round's end: newer weights may load
        try:
            while True:
                group.weights.load(group.weights.loaded + 1, wait=True)
        except Stopped:
            pass

    announced = [threading.Event() for _ in range(STEPS + 1)]

    def trainer(rank: int) -> None:
        sender = WeightSender(plan, rank, RecordingBridge(weights[rank], log, None))  # type: ignore[arg-type]
        local = {t: torch.zeros(s.shape) for t, s in enumerate(plan.specs)}
        if rank == 0:
            for g in groups:
                g.link.links.control.messages.put(Start(0, 0, None, 0))  # type: ignore[union-attr]
        for version in range(STEPS + 1):
            time.sleep(rng.uniform(0.0, 0.03))  # an optimizer step
            if rank == 0:
                for g in groups:
                    g.link.links.control.messages.put(Push(version))  # type: ignore[union-attr]
                announced[version].set()
            assert announced[version].wait(TIMEOUT)
            sender.send(local, version)
        if rank == 0:
            for g in groups:
                g.link.links.control.messages.put(Stop())  # type: ignore[union-attr]

    threads = []
    for rank, group in enumerate(groups):
        threads.append(
            threading.Thread(target=guarded(group.link.receive_loop), name=f"r{rank}-control")
        )
        threads.append(
            threading.Thread(target=guarded(lambda g=group: rollout_main(g)), name=f"r{rank}-main")
        )
    threads += [threading.Thread(target=guarded(lambda r=r: trainer(r))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a rank is stuck"
    return log, groups, errors


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rollout_ranks_issue_one_order_of_collectives_from_the_engine_thread(seed):
    log, groups, errors = _run(seed)
    assert not errors, errors
    orders = [[group for group, _ in log.by_rank[r]] for r in range(ROLLOUT_RANKS)]
    assert orders[0] == orders[1]
    for rank in range(ROLLOUT_RANKS):
        threads = {thread for _, thread in log.by_rank[rank]}
        assert threads == {f"r{rank}-main"}, threads  # the control thread issues none
        weight_ops = [g for g in orders[rank] if g.startswith("weights/")]
        per_push = len(weight_ops) // (STEPS + 1)
        assert per_push > 0 and len(weight_ops) == per_push * (STEPS + 1)  # every push, whole
        assert orders[rank].count("vllm-tp") == 2 * STEPS
    assert [g.weights.loaded for g in groups] == [STEPS] * ROLLOUT_RANKS
