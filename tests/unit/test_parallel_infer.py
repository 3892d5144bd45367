"""The inference (rollout) layout math of ParallelLayout: engines, rollout ranks, micro-DP groups."""

from __future__ import annotations

import pytest

from megarl.errors import LayoutError
from megarl.parallel import ModelShape, ParallelLayout

SHAPE = ModelShape(
    num_layers=4, num_attention_heads=8, num_kv_heads=4, vocab_size=512, ffn_hidden_size=128
)


def test_rollout_engines_are_consecutive_rank_blocks():
    layout = ParallelLayout(tp=2, pp=2, dp=1, infer_tp=2)
    assert layout.rollout_dp == 2
    assert layout.rollout_group_ranks() == [[0, 1], [2, 3]]
    assert [layout.rollout_coords(r) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    one = ParallelLayout(tp=2, pp=2, infer_tp=1)
    assert one.rollout_group_ranks() == [[0], [1], [2], [3]]
    assert ParallelLayout(tp=2, pp=2).rollout_tp == 2


def test_infer_tp_must_divide_world():
    layout = ParallelLayout(tp=2, pp=1, dp=3, infer_tp=4)
    with pytest.raises(
        LayoutError, match=r"infer_tp=4 does not divide the world size 6.*\[1, 2, 3, 6\]"
    ):
        layout.check_rollout()
    with pytest.raises(LayoutError, match="infer_tp=4"):
        layout.check_model(SHAPE)
    ParallelLayout(tp=1, pp=2, dp=2, infer_tp=4).check_model(SHAPE)  # larger than training TP: fine


def test_infer_shard_sources():
    # inference shard made of two training shards (tp 4 -> infer 2)
    assert ParallelLayout(tp=4, infer_tp=2).infer_shard_sources(1) == [(2, 2, 3), (3, 3, 4)]
    # a part of one training shard (tp 2 -> infer 4), in units of 1/4
    assert ParallelLayout(tp=2, dp=2, infer_tp=4).infer_shard_sources(3) == [(1, 3, 4)]
    # uneven ratio: tp 2 -> infer 3 (units of 1/6)
    assert ParallelLayout(tp=2, dp=3, infer_tp=3).infer_shard_sources(1) == [(0, 2, 3), (1, 3, 4)]


def test_micro_dp_groups():
    # TP4xDP2, infer_tp 2: each inference shard = two neighbouring training shards of one replica
    layout = ParallelLayout(tp=4, dp=2, infer_tp=2)
    assert layout.micro_dp_group_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # TP2xPP2, infer_tp 1: the whole TP group of each stage
    assert ParallelLayout(tp=2, pp=2, infer_tp=1).micro_dp_group_ranks() == [[0, 1], [2, 3]]
    # infer_tp 4 > tp 2: one training rank per inference shard
    assert ParallelLayout(tp=2, dp=2, infer_tp=4).micro_dp_group_ranks() == [[0], [1], [2], [3]]
