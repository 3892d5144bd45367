"""The colocated rollout source (megarl.trainer.colocated_source) with a recording engine, memory
and data: the order of the memory moves around a draw and a validation pass, the sampling each
uses, and its checkpoint state restored."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from megarl.data import PromptItem
from megarl.envs.trajectory import Trajectory
from megarl.rollout.env_source import EnvSource
from megarl.rollout.multi_turn import TurnLimits
from megarl.rollout.rollout_batch import RolloutBatch
from megarl.rollout.rollout_types import SamplingConfig
from megarl.run.epochs import EpochBatches
from megarl.trainer.colocated_source import ColocatedSource, PolicyData
from megarl.trainer.trajectory_makers import EnvironmentTurns, OneReply, dataset_row

pytestmark = pytest.mark.unit

TRAIN = SamplingConfig(n=2, max_new_tokens=3)
VALIDATE = SamplingConfig(n=1, max_new_tokens=3, temperature=0.0)


class Engine:
    def __init__(self, log: list) -> None:
        self.log = log
        self.rollout_count = 0

    def to_rollout(self, before_kv_cache: Callable[[], dict[str, float]]) -> dict[str, float]:
        self.log.append("reshard")
        return {"sync/bytes": 1.0, **before_kv_cache()}

    def to_train(self) -> None:
        self.log.append("sleep")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutBatch:
        self.log.append(("generate", [list(p) for p in prompts], sampling))
        self.rollout_count += 1
        return _records(prompts)

    def generate_from(self, rows, prompts, n, source, max_failed_share):
        self.log.append(("trajectories", rows, n, source, max_failed_share))
        return _records(prompts)


def _records(prompts: Sequence[Sequence[int]]) -> RolloutBatch:
    """An empty reply to each prompt."""
    return RolloutBatch(
        [Trajectory(i, list(p)) for i, p in enumerate(prompts)], list(range(len(prompts)))
    )


class Memory:
    """The actor's memory and the roles' offload in one recorder."""

    def __init__(self, log: list) -> None:
        self.log = log

    def _move(self, what: str) -> dict[str, float]:
        self.log.append(what)
        return {f"moved/{what}": 1.0}

    def release(self) -> dict[str, float]:
        return self._move("actor release")

    def offload_model(self) -> dict[str, float]:
        return self._move("actor offload")

    def restore(self) -> dict[str, float]:
        return self._move("actor restore")

    def offload(self) -> dict[str, float]:
        return self._move("roles offload")

    def onload(self) -> dict[str, float]:
        return self._move("roles onload")


class Position:
    """A training dataset's resumable position and counters."""

    def __init__(self) -> None:
        self.state: dict[str, object] = {"seen": 4}

    def state_dict(self) -> dict[str, object]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.state = dict(state)

    def metrics(self) -> dict[str, float]:
        return {"data/filtered": 2.0}


def item(uid: int) -> PromptItem:
    return PromptItem(
        uid=uid, input_ids=[uid, uid + 1], prompt=f"p{uid}", data_source="toy", ground_truth=""
    )


def source(log: list, maker=None, val=None) -> ColocatedSource:
    memory = Memory(log)
    data = PolicyData(Position(), val, EpochBatches([[item(1), item(2)]], "no prompts"))  # type: ignore[arg-type]
    return ColocatedSource(
        Engine(log),  # type: ignore[arg-type]
        maker or OneReply(),
        data,
        TRAIN,
        VALIDATE,
        memory,  # type: ignore[arg-type]
        memory,  # type: ignore[arg-type]
    )


def test_a_draw_moves_memory_off_around_the_generation_and_back():
    log: list = []
    got = source(log).next_batch()
    assert log == [
        "roles offload",
        "actor release",
        "reshard",
        "actor offload",  # once the reshard has read the weights, before the KV cache wakes
        ("generate", [[1, 2], [2, 3]], TRAIN),
        "sleep",
        "actor restore",
        "roles onload",
    ]
    assert [it.uid for it in got.items] == [1, 2]
    assert [t.prompt_ids for t in got.rollout.trajectories] == [[1, 2], [2, 3]]
    assert {"moved/roles offload", "moved/actor offload", "sync/bytes", "timing/rollout_s"} <= set(
        got.metrics
    )


def test_validation_wakes_the_engine_once_for_every_batch_with_the_validation_sampling():
    log: list = []
    s = source(log, val=[[item(5)], [], [item(6)]])
    assert s.has_validation and not source([]).has_validation
    batches = list(s.validation_batches())
    assert [[it.uid for it in items] for items, _ in batches] == [[5], [], [6]]
    generated = [e for e in log if isinstance(e, tuple)]
    assert [e[2] for e in generated] == [VALIDATE] * 3  # every batch, an empty one too
    assert log.count("reshard") == 1 and log.count("sleep") == 1
    assert log.index("reshard") < log.index(generated[0]) and log[-1] == "roles onload"


def test_the_checkpoint_state_restores_the_data_position_and_the_rollout_count():
    first = source([])
    first.next_batch()
    state = first.checkpoint_state()
    assert (state.data, state.rollouts, state.in_flight) == ({"seen": 4}, 1, {})
    resumed = source([])
    resumed.restore(3, {"data": {"seen": 9}, "rollouts": 7, "kl_ctrl": None})
    assert resumed.engine.rollout_count == 7 and resumed.data.train.state_dict() == {"seen": 9}
    assert resumed.data_metrics() == {"data/filtered": 2.0}
    resumed.publish_weights()  # colocated: nothing to send, the next draw reshards
    resumed.draws_decided(True)
    assert resumed.checkpoint_state().rollouts == 7


def test_an_environment_gets_each_prompts_dataset_row_and_the_turn_limits():
    log: list = []
    limits = TurnLimits(max_turns=2, max_response_tokens=8, max_turn_tokens=4)
    source(log, EnvironmentTurns(limits, None, pad_id=0, max_failed_share=0.5)).next_batch()
    (call,) = [e for e in log if isinstance(e, tuple)]
    rows = [dataset_row(item(1)), dataset_row(item(2))]
    assert call == ("trajectories", rows, TRAIN.n, EnvSource(None, TRAIN, limits, 0), 0.5)
    assert dataset_row(item(1))["data_source"] == "toy"
