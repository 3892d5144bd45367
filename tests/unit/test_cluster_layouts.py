"""Which layout an elastic restart takes, and the placement of a Ray job's ranks (pure)."""

from __future__ import annotations

from functools import partial

import pytest

from megarl.cluster import placement
from megarl.cluster.layouts import (
    check_min_world_size,
    largest_layout,
    layout_for_world,
    layout_overrides,
    why_not,
)
from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from tests.assets import tiny_char_llama_dir, tiny_qwen2_dir


def _cfg(model, *extra: str):
    return load_config(
        None,
        [
            f"model.path={model}",
            "data.train_files=[unused.parquet]",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            *extra,
        ],
    )


def _at_world(cfg, dims, world: int, fits=None):
    """layout_for_world of ``cfg``'s parallel section, each candidate checked against ``cfg``."""
    return layout_for_world(cfg.parallel, dims, world, partial(why_not, cfg, dims, fits=fits))


def _largest(cfg, dims, capacity: int, min_world: int):
    check = partial(why_not, cfg, dims)
    return largest_layout(cfg.parallel, dims, capacity, min_world, check)


def test_same_tp_pp_with_a_smaller_dp_first():
    # tiny char llama: 4 heads, 2 KV heads (tp in 1, 2), 2 layers (pp in 1, 2)
    model = tiny_char_llama_dir()
    cfg = _cfg(model, "parallel.tp=2", "parallel.infer_tp=2")
    dims = ModelDims.from_pretrained(model)
    assert _at_world(cfg, dims, 2) == ParallelLayout(tp=2, pp=1, dp=1, infer_tp=2)
    # 3 ranks: TP2 does not fill them, and 3 DP ranks cannot split the batch of 4
    assert _at_world(cfg, dims, 3) is None
    # capacity 3 after one of 4 ranks is lost: the largest world that works is 2
    assert _largest(cfg, dims, 3, 1) == ParallelLayout(tp=2, pp=1, dp=1, infer_tp=2)
    assert _largest(cfg, dims, 3, 3) is None  # min_world_size 3: nothing left
    # 1 rank: TP2 cannot, the closest layout the model takes is TP1, and infer_tp 2 goes too
    assert _at_world(cfg, dims, 1) == ParallelLayout(tp=1, pp=1, dp=1)


def test_the_closest_layout_when_tp_pp_cannot_stay():
    model = tiny_qwen2_dir()  # 4 heads, 2 KV heads, 4 layers
    cfg = _cfg(model, "parallel.tp=2", "parallel.pp=2")
    dims = ModelDims.from_pretrained(model)
    assert _at_world(cfg, dims, 4) == ParallelLayout(tp=2, pp=2, dp=1)
    assert _at_world(cfg, dims, 2) == ParallelLayout(tp=2, pp=1, dp=1)
    # a memory check that refuses TP2 x PP1 moves the restart on to the next closest layout
    no_tp2pp1 = lambda cfg, layout: "too big" if (layout.tp, layout.pp) == (2, 1) else None  # noqa: E731
    assert _at_world(cfg, dims, 2, no_tp2pp1) == ParallelLayout(tp=1, pp=2, dp=1)


def test_layout_overrides_round_trip_through_the_config():
    model = tiny_qwen2_dir()
    layout = ParallelLayout(tp=2, pp=2, dp=1, pp_layers=(1, 3), infer_tp=4)
    cfg = _cfg(model, "parallel.tp=1", "parallel.infer_tp=2", *layout_overrides(layout))
    p = cfg.parallel
    assert (p.tp, p.pp, p.infer_tp, p.ep, p.pp_layers) == (2, 2, 4, 1, [1, 3])
    cfg = _cfg(model, "parallel.infer_tp=2", *layout_overrides(ParallelLayout(tp=1, pp=1, dp=2)))
    assert cfg.parallel.infer_tp is None and cfg.parallel.pp_layers is None


def test_min_world_size_checked_before_launch():
    model = tiny_char_llama_dir()
    dims = ModelDims.from_pretrained(model)
    ok = _cfg(model, "parallel.tp=2", "trainer.elastic.max_restarts=1")
    check_min_world_size(ok, dims, 4)  # the default, 1, takes TP1
    check_min_world_size(_cfg(model, "trainer.elastic.min_world_size=3"), dims, 4)  # off
    with pytest.raises(ConfigError, match=r"no layout of .* takes 3 ranks.*it takes: \[1, 2, 4\]"):
        check_min_world_size(
            _cfg(model, "trainer.elastic.max_restarts=1", "trainer.elastic.min_world_size=3"),
            dims,
            4,
        )
    with pytest.raises(ConfigError, match="larger than the job's 4 ranks"):
        check_min_world_size(
            _cfg(model, "trainer.elastic.max_restarts=1", "trainer.elastic.min_world_size=8"),
            dims,
            4,
        )


def test_elastic_settings_are_checked():
    model = tiny_char_llama_dir()
    for bad, message in (
        ("trainer.elastic.max_restarts=-1", "max_restarts=-1 must be >= 0"),
        ("trainer.elastic.min_world_size=0", "min_world_size=0 must be >= 1"),
        ("trainer.elastic.wait_s=-2", "wait_s=-2.0 must be >= 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            _cfg(model, bad)


NODES = [
    placement.NodeSlots("a", "10.0.0.1", 8),
    placement.NodeSlots("b", "10.0.0.2", 8),
    placement.NodeSlots("c", "10.0.0.3", 4),
]


def test_placement_packs_ranks_node_by_node():
    placed = placement.plan(NODES, [], 12, one_node=False, first="b")
    assert [(n.node_id, k) for n, k in placed] == [("b", 8), ("a", 4)]
    table = placement.rank_table(placed)
    assert [(n.node_id, local) for n, local in table[7:9]] == [("b", 7), ("a", 0)]
    assert placement.plan(NODES, [], 21, one_node=False) is None
    assert placement.capacity(NODES, [], one_node=False) == 20
    # one node only: the largest holds at most 8
    assert placement.capacity(NODES, [], one_node=True) == 8
    assert placement.plan(NODES, [], 9, one_node=True) is None
    [(node, k)] = placement.plan(NODES, [], 4, one_node=True, first="c")
    assert (node.node_id, k) == ("a", 4)  # the fullest first; the driver's only among equals


def test_placement_leaves_lost_slots_out():
    lost = ["a", "a", "c"]  # two ranks failed on node a, one on c
    assert [k for _, k in placement.usable(NODES, lost)] == [6, 8, 3]
    assert placement.capacity(NODES, lost, one_node=False) == 17
    placed = placement.plan(NODES, lost, 16, one_node=False)
    assert [(n.node_id, k) for n, k in placed] == [("b", 8), ("a", 6), ("c", 2)]


def test_visible_devices_in_the_nodes_order():
    # ranks 0-3 of a node got GPUs 3, 10, 1, 2: each sees all four, in the node's numbering
    gpus = {0: "3", 1: "10", 2: "1", 3: "2"}
    assert placement.visible_devices(gpus, [0, 1, 2, 3]) == ["1", "2", "3", "10"]
