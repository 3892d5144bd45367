"""DAPO dynamic sampling's bookkeeping: which groups are kept, how draws are merged and cut to the
step's prompt count, and the counts it logs; and DAPO's overlong reward shaping."""

from __future__ import annotations

import pytest
import torch

from megarl.rewards.overlong import overlong_penalty
from megarl.trainer.batch import Samples
from megarl.trainer.dynamic_sampling import GroupPool, concat_samples, varied_groups

pytestmark = pytest.mark.unit


def draw(groups: dict[str, list[float]], resp_len: int, seed: int):
    """A rollout of len(groups) prompts; group g's samples score groups[g]."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, ids, scores = [], [], [], []
    for k, (g, s) in enumerate(groups.items()):
        for j, score in enumerate(s):
            prompts.append([k + 1, 2, 3])
            responses.append(list(range(1, 1 + (resp_len + j) % (resp_len + 1) + 1)))
            ids.append(g)
            scores.append(score)
    samples = Samples.from_sequences(prompts, responses, ids, pad_id=0, device="cpu")
    samples.tensors["old_log_prob"] = -torch.rand(samples.response_mask.shape, generator=gen)
    reasons = ["length" if len(r) > resp_len else "stop" for r in responses]
    return samples, torch.tensor(scores), reasons


def test_varied_groups_in_order():
    ids = ["a", "a", "b", "b", "c", "c"]
    assert varied_groups(ids, torch.tensor([1.0, 1.0, 0.0, 1.0, 0.2, 0.3])) == ["b", "c"]
    assert varied_groups(ids, torch.tensor([0.0] * 6)) == []


def test_pool_keeps_varied_groups_over_draws_and_cuts_to_the_target():
    pool = GroupPool(target_groups=3)
    s1, sc1, r1 = draw({"A": [1, 1], "B": [0, 1], "C": [0, 0]}, resp_len=3, seed=1)
    pool.add(s1, sc1, r1)
    assert pool.groups_kept == 1 and pool.groups_drawn == 3
    # the second draw has longer responses (tensors are padded on merge); "B" again is another group
    s2, sc2, r2 = draw({"B": [0.5, 0.0], "D": [1, 1], "E": [0.2, 0.9], "F": [1, 0]}, 6, seed=2)
    pool.add(s2, sc2, r2)
    assert (pool.draws, pool.groups_drawn, pool.groups_kept) == (2, 7, 4)

    samples, scores, reasons = pool.take(3, pad_id=0)
    assert samples.group_ids == [(0, "B"), (0, "B"), (1, "B"), (1, "B"), (1, "E"), (1, "E")]
    assert scores.tolist() == pytest.approx([0, 1, 0.5, 0.0, 0.2, 0.9])
    # rows are the original rows: B of draw 0 is rows 2-3 of s1, E of draw 1 rows 4-5 of s2
    expect = [(s1, 2), (s1, 3), (s2, 0), (s2, 1), (s2, 4), (s2, 5)]
    assert reasons == [r1[2], r1[3], r2[0], r2[1], r2[4], r2[5]]
    for row, (src, i) in enumerate(expect):
        n_resp = int(src.response_lens[i])
        assert int(samples.response_lens[row]) == n_resp
        seq = int(src.seq_lens()[i])
        assert torch.equal(samples.input_ids[row, :seq], src.input_ids[i, :seq])
        assert (samples.input_ids[row, seq:] == 0).all()
        assert torch.equal(
            samples.tensors["old_log_prob"][row, :n_resp], src.tensors["old_log_prob"][i, :n_resp]
        )
        assert samples.response_mask[row].sum() == n_resp
    m = pool.metrics(3)
    assert m["dynamic_sampling/groups_drawn"] == 7 and m["dynamic_sampling/groups_kept"] == 4
    assert m["dynamic_sampling/groups_trained"] == 3 and m["dynamic_sampling/batches"] == 2
    assert m["dynamic_sampling/reward_mean_drawn"] == pytest.approx(
        float(torch.cat([sc1, sc2]).mean())
    )


def test_pool_with_nothing_varied_keeps_nothing():
    pool = GroupPool(target_groups=2)
    s, sc, r = draw({"A": [1, 1], "B": [0, 0]}, resp_len=2, seed=3)
    pool.add(s, sc, r)
    assert pool.groups_kept == 0 and pool.pieces == []


def test_concat_pads_every_tensor():
    s1, _, _ = draw({"A": [1, 0]}, resp_len=2, seed=4)
    s2, _, _ = draw({"B": [1, 0]}, resp_len=5, seed=5)
    merged = concat_samples([s1, s2], pad_id=0)
    assert merged.size == 4 and merged.input_ids.shape[1] == s2.input_ids.shape[1]
    assert merged.response_mask.shape[1] == merged.tensors["old_log_prob"].shape[1]
    assert merged.response_mask[:2].sum() == s1.response_mask.sum()


def test_overlong_penalty_follows_the_dapo_paper():
    lengths = torch.tensor([10, 12, 14, 16, 20])
    # L_max = 16, buffer 4: no penalty up to 12, then linear to -1 at 16, -1 beyond
    p = overlong_penalty(lengths, max_length=16, buffer_length=4, penalty_factor=1.0)
    assert p.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    p = overlong_penalty(lengths, max_length=16, buffer_length=4, penalty_factor=0.5)
    assert p.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError):
        overlong_penalty(lengths, max_length=16, buffer_length=0, penalty_factor=1.0)
