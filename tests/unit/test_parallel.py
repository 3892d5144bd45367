"""ParallelLayout: world size, divisibility against the model, uneven pipeline splits, rank math."""

from __future__ import annotations

import pytest

from megarl.errors import LayoutError
from megarl.parallel import ModelShape, ParallelLayout

QWEN_7B = ModelShape(
    num_layers=28, num_attention_heads=28, num_kv_heads=4, vocab_size=152064, ffn_hidden_size=18944
)
SMOLLM2 = ModelShape(
    num_layers=30, num_attention_heads=9, num_kv_heads=3, vocab_size=49152, ffn_hidden_size=1536
)


def test_world_size_and_for_world():
    layout = ParallelLayout.for_world(8, tp=2, pp=2)
    assert (layout.tp, layout.pp, layout.dp, layout.world_size) == (2, 2, 2, 8)
    with pytest.raises(
        LayoutError, match=r"world size 6 is not divisible by tp\*pp = 2\*2 = 4.*\[1, 2, 3, 6\]"
    ):
        ParallelLayout.for_world(6, tp=2, pp=2)


def test_world_size_mismatch_names_the_fix():
    with pytest.raises(
        LayoutError, match=r"needs tp\*pp\*dp = 4 processes but the job has 8; .*parallel.dp = 2"
    ):
        ParallelLayout(tp=2, pp=2).check_world_size(8)


def test_tp_must_divide_heads_and_kv_heads():
    with pytest.raises(
        LayoutError,
        match=r"tp=2 .*attention heads 9, KV heads 3.*Valid tp for this model: \[1, 3\]",
    ):
        ParallelLayout(tp=2).check_model(SMOLLM2)
    with pytest.raises(LayoutError, match=r"Valid tp for this model: \[1, 2, 4\]"):
        ParallelLayout(tp=8).check_model(QWEN_7B)
    ParallelLayout(tp=4, pp=2).check_model(QWEN_7B)
    ParallelLayout(tp=3).check_model(SMOLLM2)


def test_infer_tp_validated_too():
    with pytest.raises(
        LayoutError, match=r"infer_tp=8 .*Valid infer_tp for this model: \[1, 2, 4\]"
    ):
        ParallelLayout(tp=2, infer_tp=8).check_model(QWEN_7B)


def test_pp_larger_than_layers_and_not_dividing():
    tiny = ModelShape(
        num_layers=4, num_attention_heads=4, num_kv_heads=2, vocab_size=512, ffn_hidden_size=128
    )
    with pytest.raises(
        LayoutError, match=r"pp=8 is larger than the model's 4 layers; valid pp: \[1, 2, 4\]"
    ):
        ParallelLayout(pp=8).check_model(tiny)
    with pytest.raises(
        LayoutError, match=r"pp=3 does not divide the model's 4 layers.*parallel.pp_layers"
    ):
        ParallelLayout(pp=3).check_model(tiny)


def test_uneven_pipeline_split():
    layout = ParallelLayout(pp=4, pp_layers=(6, 8, 8, 8))
    layout.check_model(SMOLLM2)
    assert layout.layers_per_stage(30) == [6, 8, 8, 8]
    assert layout.megatron_stage_kwargs(30) == {
        "num_layers_in_first_pipeline_stage": 6,
        "num_layers_in_last_pipeline_stage": 8,
    }
    with pytest.raises(LayoutError, match="summing to the model's 30 layers"):
        ParallelLayout(pp=4, pp_layers=(6, 8, 8, 7)).check_model(SMOLLM2)
    with pytest.raises(LayoutError, match="middle stages must hold equal"):
        ParallelLayout(pp=4, pp_layers=(7, 9, 7, 7)).check_model(SMOLLM2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(LayoutError, match="positive integer"):
        ParallelLayout(tp=bad)


def test_rank_groups_partition_the_world():
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    for groups in (layout.tp_group_ranks(), layout.pp_group_ranks(), layout.dp_group_ranks()):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(8))
    # megatron's default order: TP fastest, then DP, then PP.
    assert layout.tp_group_ranks()[0] == [0, 1]
    assert layout.dp_group_ranks()[0] == [0, 2]
    assert layout.pp_group_ranks()[0] == [0, 4]
    for rank in range(8):
        assert layout.rank_of(*layout.coords(rank)) == rank
