"""The pure pieces of asynchronous training: the world split's rank math, round-by-round
generation with versions (on a fake engine), the rollout group's split and merge of a batch, the
validation schedule, staleness metrics, the staging of weights and the plain-data form of a
generated batch (what a checkpoint keeps)."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, replace

import pytest

from megarl.config import load_config
from megarl.data import PromptItem
from megarl.envs.trajectory import Trajectory
from megarl.rollout.rollout_batch import replies_batch
from megarl.rollout.rollout_messages import TRAIN, Draws, Generated, Part
from megarl.rollout.rollout_split import engine_slice
from megarl.rollout.rollout_types import RolloutOutput, SamplingConfig
from megarl.rollout.seeds import request_seeds, sample_seeds, sequence_seed
from megarl.rollout.versioned import generate_versioned
from megarl.run.trainer_state import check_plain
from megarl.trainer.remote_rollout import RemoteRollout, staleness_metrics
from megarl.trainer.rollout_group import RolloutGroup, Stopped
from megarl.trainer.rollout_group_parts import (
    split_trajectories,
    validation_due,
)
from megarl.trainer.trajectory_makers import OneReply
from megarl.weights.weight_sync import Staged, StagedWeights, SyncStats
from megarl.world_split import ROLLOUT, TRAINER, WorldSplit
from tests.async_settings import group_settings

STOP = 99


class FakeEngine:
    """Token k of sample j of a request seeded s is ``(s + j + len(prompt) + k) % 50``; a
    sequence starting with 7 stops (token STOP) as its 6th token. Records every call (prompts,
    sampling, the requests' seeds)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], SamplingConfig, list[int]]] = []

    def generate(
        self, prompts, sampling: SamplingConfig, seed_offset: int = 0, *, seeds=None
    ) -> RolloutOutput:
        assert seeds is not None, "a run seeds every request"
        self.calls.append(([list(p) for p in prompts], sampling, list(seeds)))
        out = RolloutOutput()
        for i, p in enumerate(prompts):
            for j in range(sampling.n):
                seed = seeds[i] + j
                tokens, reason = [], "length"
                for k in range(sampling.max_new_tokens):
                    if p[0] == 7 and len(p) + k == 5:
                        tokens.append(STOP)
                        reason = "stop"
                        break
                    tokens.append((seed + len(p) + k) % 50)
                out.prompt_index.append(i)
                out.token_ids.append(tokens)
                out.logprobs.append([-0.1 * (t + 1) for t in tokens])
                out.finish_reasons.append(reason)
        return out


def test_world_split_rank_math():
    split = WorldSplit(world_size=6, rollout_ranks=2)
    assert split.trainers == 4 and split.trainer_ranks == [0, 1, 2, 3]
    assert split.rollout_global_ranks == [4, 5] and split.rollout_leader == 4
    assert [split.role(r) for r in range(6)] == [TRAINER] * 4 + [ROLLOUT] * 2
    assert [split.local_rank(r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert split.world_of(1) == 4 and split.world_of(5) == 2
    for bad in (0, 6):
        with pytest.raises(ValueError, match="rollout ranks"):
            WorldSplit(6, bad)
    with pytest.raises(ValueError, match="outside"):
        split.role(6)


def test_one_round_without_partial_is_one_call_at_one_version():
    engine = FakeEngine()
    sampling = SamplingConfig(max_new_tokens=5, n=2, seed=3)
    out = generate_versioned(engine, [[1, 2], [3]], sampling, rollout=6, first_prompt=5, version=4)
    # prompts 5 and 6 of rollout 6: their samples are 10..13 of it
    assert len(engine.calls) == 1 and engine.calls[0][2] == request_seeds(3, 6, 10, 2, 2)
    assert out.versions == [[4] * 5] * 4 and out.rounds == 1


def test_rounds_continue_every_response_with_the_new_version():
    engine, sampling = FakeEngine(), SamplingConfig(max_new_tokens=7, n=2)
    prompts = [[1, 2, 3], [7, 8]]  # the second stops with its 4th new token (in round 2)
    versions = iter([1, 2])
    seen: list[bool] = []

    def between(active: bool) -> int:
        seen.append(active)
        return next(versions)

    out = generate_versioned(engine, prompts, sampling, 10, 0, 0, chunk=3, between=between)
    assert out.rounds == 3 and seen == [True, True]  # ceil(7 / 3) rounds, a check between each
    first, second, third = engine.calls
    assert first[1].max_new_tokens == 3 and first[1].n == 2
    assert first[2] == request_seeds(sampling.seed, 10, 0, 2, 2)
    # round 2 continues all 4 responses, one request each, prompt + its tokens so far, each on
    # its own stream: its sample's, in segment (round) 1
    assert len(second[0]) == 4 and second[1].n == 1
    assert second[2] == [sequence_seed(sampling.seed, 10, k, segment=1) for k in range(4)]
    assert not set(second[2]) & set(sample_seeds(first[2], 2))
    assert second[0][0] == prompts[0] + out.output.token_ids[0][:3]
    # round 3: the stopped responses are done; the others need 1 more token (7 = 3 + 3 + 1)
    assert len(third[0]) == 2 and third[1].max_new_tokens == 1
    for k, reason in enumerate(out.output.finish_reasons):
        tokens, versions = out.output.token_ids[k], out.versions[k]
        assert len(tokens) == len(versions) == len(out.output.logprobs[k])
        if out.output.prompt_index[k] == 1:
            assert reason == "stop" and tokens[-1] == STOP and versions == [0, 0, 0, 1]
        else:
            assert reason == "length" and versions == [0] * 3 + [1] * 3 + [2]


def test_rounds_keep_lockstep_after_this_engine_is_done():
    engine, sampling = FakeEngine(), SamplingConfig(max_new_tokens=9, n=1)
    calls: list[bool] = []
    out = generate_versioned(
        engine, [[7, 1]], sampling, 0, 0, 0, chunk=3, between=lambda a: calls.append(a) or 0
    )
    # done after round 2, but the engine still meets the other engines at every round
    assert calls == [True, False] and len(engine.calls) == 2 and out.rounds == 3


def test_a_batch_of_replies_is_split_back_by_trainer_rank_with_each_tokens_version():
    assert [engine_slice(10, 3, e) for e in range(3)] == [(0, 3), (3, 6), (6, 10)]
    step = []
    for sample in range(5):  # one reply each (n=1); partial rounds left versions 0 then 1
        t = Trajectory(sample, [1, sample])
        t.add_model_turn([sample, sample], [-0.1, -0.2])
        t.versions, t.finish = [0, 1], "stop"
        step.append(t)
    step[4].versions = None  # recorded none: the batch's version
    items = [[_item(0), _item(1)], [_item(2), _item(3), _item(4)]]
    parts = split_trajectories(step, items, 1, version=7, conversations=False)
    assert [p.batch.prompt_index for p in parts] == [[0, 1], [0, 1, 2]]
    assert [[t.response_ids for t in p.batch.trajectories] for p in parts] == [
        [[0, 0], [1, 1]],
        [[2, 2], [3, 3], [4, 4]],
    ]
    assert parts[1].versions == [[0, 1], [0, 1], [7, 7]] and parts[0].items == items[0]
    # plain replies: no conversations, no masks (every token is the model's)
    assert not any(p.batch.conversations or p.batch.response_masks for p in parts)


def _item(uid: int) -> PromptItem:
    return PromptItem(uid, [1, uid], [{"role": "user", "content": str(uid)}], "toy", str(uid))


def test_validation_schedule_of_the_rollout_group():
    base = ["model.path=/m", "data.train_files=[a]", "data.val_files=[v]"]
    cfg = load_config(
        overrides=[
            *base,
            "trainer.total_steps=6",
            "trainer.test_freq=2",
            "trainer.val_before_train=true",
        ]
    )
    assert [v for v in range(8) if validation_due(cfg.data, cfg.trainer, v, first=0)] == [
        0,
        2,
        4,
        6,
    ]
    assert [v for v in range(8) if validation_due(cfg.data, cfg.trainer, v, first=2)] == [
        4,
        6,
    ]  # resumed at 2
    none = load_config(overrides=[base[0], base[1], "trainer.test_freq=2"])
    assert not any(
        validation_due(none.data, none.trainer, v, 0) for v in range(6)
    )  # no validation files


def test_staleness_metrics_per_sample():
    m = staleness_metrics([[3, 3], [2, 3], [], [1]], trained_version=3)
    assert m["rollout/staleness_mean"] == pytest.approx((0 + 1 + 2) / 3)
    assert m["rollout/staleness_max"] == 2.0
    assert m["rollout/mixed_version_frac"] == pytest.approx(1 / 3)


def test_staged_weights_keep_a_pinned_version_until_it_is_loaded():
    staged = StagedWeights()
    staged.put(Staged(1, [], SyncStats(), pinned=False))
    staged.put(Staged(2, [], SyncStats(), pinned=True))  # replaces 1, not yet loaded
    assert staged.version() == 2 and staged.get(1) is None and staged.get(2) is not None
    done = threading.Event()

    def put_three() -> None:
        staged.put(Staged(3, [], SyncStats()))
        done.set()

    threading.Thread(target=put_three, daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set() and staged.version() == 2  # 3 waits: 2 must be validated
    staged.consume(2)
    assert done.wait(5) and staged.version() == 3
    staged.wait_newer(2)  # returns at once: 3 waits
    staged.close(RuntimeError("link down"))
    with pytest.raises(RuntimeError, match="receiving the trainers' weights failed"):
        staged.version()


def test_a_generated_batch_round_trips_as_plain_data():
    output = RolloutOutput(
        prompt_index=[0], token_ids=[[4, 2]], logprobs=[[-1.0, -2.0]], finish_reasons=["length"]
    )
    part = Part([_item(5)], replies_batch([[1, 5]], output), [[3, 4]])
    message = Generated(TRAIN, 7, [[part]], rollouts=9, data={"format": "x"}, metrics={"g": 1.0})
    plain = message.to_plain()
    check_plain(plain)  # what the trainer state accepts
    again = Generated.from_plain(plain)
    assert again == message
    assert replace(again, step=8) != message
    assert again.key == (TRAIN, 7, 0)
    # a checkpoint of the release before the typed record held the engine's output instead
    earlier = {
        **plain,
        "parts": [
            [
                {
                    "items": plain["parts"][0][0]["items"],
                    "output": asdict(output),
                    "versions": [[3, 4]],
                }
            ]
        ],
    }
    check_plain(earlier)
    assert Generated.from_plain(earlier) == message


def _trajectory(sample: int, model: list[int], env: list[int]) -> Trajectory:
    t = Trajectory(sample=sample, prompt_ids=[1, sample])
    t.messages = [{"role": "user", "content": f"q{sample}"}]
    t.add_model_turn(model, [-0.5] * len(model))
    t.add_env_tokens(env)
    t.add_model_turn([9], [-0.25])
    t.turn_rewards += [0.5, 1.0]
    t.end("stop")
    return t


def test_trajectories_split_by_trainer_rank_keep_masks_and_round_trip():
    """A multi-turn batch of 3 prompts x n=2 over 2 trainer ranks (2 prompts, 1 prompt): each
    rank gets its samples' trajectories, indices local, masks 0 at the environment's tokens, every
    token of the loaded version; the message round-trips through a checkpoint's plain data."""
    n = 2
    step = [_trajectory(s, [3] * (s + 1), [7, 7]) for s in range(3 * n)]
    items = [[_item(0), _item(1)], [_item(2)]]
    parts = split_trajectories(step, items, n, version=4)
    assert [p.batch.prompt_index for p in parts] == [[0, 0, 1, 1], [0, 0]]
    assert [[t.sample for t in p.batch.trajectories] for p in parts] == [[0, 1, 2, 3], [4, 5]]
    for part in parts:
        assert part.batch.conversations
        for t, mask, v in zip(
            part.batch.trajectories, part.batch.response_masks or [], part.versions, strict=True
        ):
            ids = t.response_ids
            assert mask == t.mask
            assert [i for i, m in zip(ids, mask, strict=True) if m == 0] == [7, 7]
            assert v == [4] * len(ids)
    message = Generated(TRAIN, 3, [[p] for p in parts], rollouts=2, draw=1)
    plain = message.to_plain()
    check_plain(plain)
    again = Generated.from_plain(plain)
    assert again == message and again.key == (TRAIN, 3, 1)
    assert again.parts[1][0].batch.trajectories[0].final_text == ""  # no assistant message
    assert again.parts[0][0].batch.trajectories[1].env_reward == 1.5


def bare_group(overrides: list[str], sampling: SamplingConfig) -> RolloutGroup:
    """A rollout rank of ``overrides``' run with no engine, links or prompts."""
    settings = group_settings(load_config(overrides=overrides))
    return RolloutGroup.build(
        settings, 0, 1, None, None, None, sampling, sampling, None, OneReply()
    )  # type: ignore[arg-type]


def test_dynamic_sampling_draws_follow_the_trainers_verdicts():
    """The rollout group draws again for batch ``s`` while the trainers ask for more, then moves
    on; a verdict on another draw than the last one sent, or the trainers stopping, ends it."""
    base = ["model.path=/m", "data.train_files=[a]", "algorithm.filter_groups=true"]
    sampling = SamplingConfig(n=1, max_new_tokens=4)
    group = bare_group(base, sampling)
    drawn: list[tuple[int, int]] = []
    group._draw = lambda step, draw: drawn.append((step, draw))  # type: ignore[method-assign]
    for draw, more in ((0, True), (1, True), (2, False)):
        group.link._verdicts.put(Draws(3, draw, more))
    group.train_batch(3)
    assert drawn == [(3, 0), (3, 1), (3, 2)]
    group.link._verdicts.put(Draws(4, 1, True))
    with pytest.raises(RuntimeError, match="judged draw 1 of batch 4"):
        group.train_batch(4)
    group.link._verdicts.put(None)  # the trainers stopped
    with pytest.raises(Stopped):
        group.extra_draws(5)
    off = bare_group(base[:2], sampling)
    off._draw = lambda step, draw: drawn.append((step, draw))  # type: ignore[method-assign]
    off.train_batch(6)  # no dynamic sampling: one draw, no verdict awaited
    assert drawn[-1] == (6, 0) and off.link._verdicts.empty()


def test_publishing_pushes_the_new_weights_while_a_batch_is_left_to_generate():
    """After an optimizer step the trainers broadcast the weights at once (the asynchronous
    source's publish_weights), except after the last step: the rollout group takes no weights
    once its last batch is out."""
    remote = RemoteRollout.__new__(RemoteRollout)  # no links: only the version bookkeeping
    remote.first, remote.delivered, remote._untrained, remote.total_steps = 1, 1, 0, 3
    pushed: list[int] = []
    remote.push = lambda: pushed.append(remote.version)  # type: ignore[method-assign]
    remote.publish()  # version 2 of 3
    remote.delivered = 2
    remote.publish()  # version 3: the run's last step was taken
    assert pushed == [2]
