"""DAPO dynamic sampling's bookkeeping: which groups are kept, how draws are merged and cut to the
step's prompt count, the same groups at one process and at DP2, and the counts it logs; and
DAPO's overlong reward shaping."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from megarl.config import AlgorithmConfig
from megarl.metrics import StepMetrics, maximum, mean
from megarl.rewards.overlong import overlong_penalty
from megarl.trainer.batch import Samples, StepBatch
from megarl.trainer.dynamic_sampling import (
    GroupPool,
    assemble,
    concat_samples,
    filter_groups,
    outgoing_packages,
    varied_groups,
)
from megarl.trainer.group_selection import (
    DrawFacts,
    deal,
    groups_drawn,
    kept_groups,
    reward_mean_drawn,
    select,
    wants_more,
)

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
    samples.tensors.old_log_prob = -torch.rand(samples.response_mask.shape, generator=gen)
    reasons = ["length" if len(r) > resp_len else "stop" for r in responses]
    return samples, torch.tensor(scores, dtype=torch.float32), reasons


def test_varied_groups_in_order():
    ids = ["a", "a", "b", "b", "c", "c"]
    assert varied_groups(ids, torch.tensor([1.0, 1.0, 0.0, 1.0, 0.2, 0.3])) == ["b", "c"]
    assert varied_groups(ids, torch.tensor([0.0] * 6)) == []


def test_pool_keeps_varied_groups_over_draws_and_takes_them_in_the_order_asked():
    pool = GroupPool()
    s1, sc1, r1 = draw({"A": [1, 1], "B": [0, 1], "C": [0, 0]}, resp_len=3, seed=1)
    f1 = pool.add(s1, sc1, r1)
    assert f1 == DrawFacts((False, True, False), float(sc1.sum()), 6)
    # the second draw has longer responses (tensors are padded on merge); "B" again is another group
    s2, sc2, r2 = draw({"B": [0.5, 0.0], "D": [1, 1], "E": [0.2, 0.9], "F": [1, 0]}, 6, seed=2)
    f2 = pool.add(s2, sc2, r2)
    assert f2.varied == (True, False, True, True) and pool.draws == 2

    # (draw, index among the draw's groups): B of draw 0, B and E of draw 1
    samples, scores, reasons = pool.take([(0, 1), (1, 0), (1, 2)], pad_id=0)
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
            samples.tensors.require("old_log_prob")[row, :n_resp],
            src.tensors.require("old_log_prob")[i, :n_resp],
        )
        assert samples.response_mask[row].sum() == n_resp
    # the order asked, not the draw order
    later_first = pool.take([(1, 3), (0, 1)], pad_id=0)[0]
    assert later_first.group_ids == [(1, "F"), (1, "F"), (0, "B"), (0, "B")]


def test_pool_with_nothing_varied_keeps_nothing():
    pool = GroupPool()
    s, sc, r = draw({"A": [1, 1], "B": [0, 0]}, resp_len=2, seed=3)
    assert pool.add(s, sc, r).varied == (False, False)
    assert pool.pieces == [] and pool.ids == {}


def test_concat_pads_every_tensor():
    s1, _, _ = draw({"A": [1, 0]}, resp_len=2, seed=4)
    s2, _, _ = draw({"B": [1, 0]}, resp_len=5, seed=5)
    merged = concat_samples([s1, s2], pad_id=0)
    assert merged.size == 4 and merged.input_ids.shape[1] == s2.input_ids.shape[1]
    assert merged.response_mask.shape[1] == merged.tensors.require("old_log_prob").shape[1]
    assert merged.response_mask[:2].sum() == s1.response_mask.sum()


Draw = tuple[Samples, torch.Tensor, list[str]]


def split(whole: Draw, dp: int) -> list[Draw]:
    """Each DP rank's part of a draw: its contiguous share of the draw's groups (DP rank order is
    prompt order, as the data loader deals a batch's prompts)."""
    samples, scores, reasons = whole
    groups = list(dict.fromkeys(samples.group_ids))
    share = len(groups) // dp
    parts = []
    for r in range(dp):
        mine = set(groups[r * share : (r + 1) * share])
        rows = [i for i, g in enumerate(samples.group_ids) if g in mine]
        parts.append((samples.select(rows), scores[rows], [reasons[i] for i in rows]))
    return parts


def run_rule(draws: list[Draw], dp: int, target: int, max_draws: int):
    """Dynamic sampling's decisions as every DP rank takes them from the gathered facts (what
    filter_groups does around its collectives): the facts of the draws made, the selection, and
    each rank's share of it, its rows moved from the ranks that drew them."""
    pools = [GroupPool() for _ in range(dp)]
    facts: list[list[DrawFacts]] = []
    for whole in draws:
        facts.append([pool.add(*part) for pool, part in zip(pools, split(whole, dp), strict=True)])
        if not wants_more(facts, target, max_draws):
            break
    selected = select(facts, target, dp)
    if not selected:  # filter_groups trains the last draw as it is
        return facts, selected, []
    sent = [outgoing_packages(pool, selected, dp, r, pad_id=0) for r, pool in enumerate(pools)]
    slices = deal(selected, dp)
    shares = []
    for r, mine in enumerate(slices):
        received = [sent[source][r] for source in range(dp)]  # what dp_exchange hands rank r
        # a rank receives the rows of its own slice only, each group from the rank that drew it
        assert sorted(k for part in received for k in part) == sorted(
            (g.draw, g.index) for g in mine
        )
        assert all(
            g.rank == s
            for s, part in enumerate(received)
            for g in mine
            if (g.draw, g.index) in part
        )
        shares.append(assemble(received, mine, 0, torch.device("cpu")))
    return facts, selected, shares


def trained_rows(shares) -> list[tuple]:
    """Every rank's trained rows in rank order: (prompt, response, score, finish, old logprobs)."""
    out = []
    for samples, scores, reasons in shares:
        for i in range(samples.size):
            p, n = int(samples.prompt_lens[i]), int(samples.response_lens[i])
            ids = samples.input_ids[i].tolist()
            logp = samples.tensors.require("old_log_prob")[i, :n].tolist()
            out.append((ids[:p], ids[p : p + n], float(scores[i]), reasons[i], logp))
    return out


# Three draws of 4 prompt groups (2 samples each). Varied: C, D (the second half of draw 0: DP
# rank 1's at DP2), then E (rank 0), G, H (rank 1). The step's first 4 varied groups are C D E G.
THREE_DRAWS = [
    draw({"A": [1, 1], "B": [0, 0], "C": [0, 1], "D": [1, 0]}, resp_len=3, seed=11),
    draw({"E": [0, 1], "F": [1, 1], "G": [0.2, 0.9], "H": [1, 0]}, resp_len=5, seed=12),
    draw({"I": [0, 1], "J": [1, 0], "K": [0, 1], "L": [1, 0]}, resp_len=4, seed=13),
]


def test_the_selection_at_dp2_equals_the_selection_at_one_process():
    """The same draws at DP1 and DP2: the same draws made, the same groups selected in the same
    order, and the ranks' shares together the one process's batch, row by row. (The rule each
    DP rank filling its half of the step from its half of each draw would draw a third time at
    DP2, rank 0 holding one varied group of the two it needs, and train other groups.)"""
    one_facts, one_sel, one_share = run_rule(THREE_DRAWS, dp=1, target=4, max_draws=3)
    two_facts, two_sel, two_shares = run_rule(THREE_DRAWS, dp=2, target=4, max_draws=3)
    assert len(one_facts) == len(two_facts) == 2  # 5 varied groups in two draws: enough
    assert [(g.draw, g.index) for g in one_sel] == [(0, 2), (0, 3), (1, 0), (1, 2)]
    assert [(g.draw, g.index) for g in two_sel] == [(g.draw, g.index) for g in one_sel]
    # C and D are rank 1's at DP2 but rank 0's slice: their rows move
    assert [g.rank for g in two_sel] == [1, 1, 0, 1]
    one = trained_rows(one_share)
    assert len(one) == 8 and trained_rows(two_shares) == one
    assert [len(trained_rows([s])) for s in two_shares] == [4, 4]
    # at one process filter_groups takes the pool's rows directly: the same rows
    pool = GroupPool()
    for whole in THREE_DRAWS[:2]:
        pool.add(*whole)
    assert trained_rows([pool.take([(g.draw, g.local) for g in one_sel], pad_id=0)]) == one
    for facts in (one_facts, two_facts):
        assert groups_drawn(facts) == 8 and len(kept_groups(facts)) == 5
        expected = float(torch.cat([THREE_DRAWS[0][1], THREE_DRAWS[1][1]]).mean())
        assert reward_mean_drawn(facts) == pytest.approx(expected, abs=1e-6)  # fp32 sums


def test_a_short_step_is_cut_to_a_multiple_of_the_dp_size():
    """The draw limit reached with 3 varied groups: one process trains the 3, DP2 the first 2
    (ranks train as many groups), whichever rank drew them; with 1 varied group DP2 selects none
    (the fallback)."""
    draws = THREE_DRAWS[1:2]  # E, G, H varied
    _, one_sel, _ = run_rule(draws, dp=1, target=4, max_draws=1)
    _, two_sel, two_shares = run_rule(draws, dp=2, target=4, max_draws=1)
    assert [g.index for g in one_sel] == [0, 2, 3]
    assert [g.index for g in two_sel] == [0, 2]
    assert [s[0].group_ids for s in two_shares] == [[(0, "E")] * 2, [(0, "G")] * 2]
    # both varied groups of a draw are DP rank 1's: DP2 trains both, as one process does
    for dp in (1, 2):
        assert [g.index for g in run_rule(THREE_DRAWS[:1], dp, 4, max_draws=1)[1]] == [2, 3]
    lone = [draw({"A": [1, 1], "B": [0, 1], "C": [0, 0], "D": [1, 1]}, resp_len=3, seed=14)]
    assert len(run_rule(lone, dp=1, target=4, max_draws=1)[1]) == 1
    assert run_rule(lone, dp=2, target=4, max_draws=1)[1] == []
    with pytest.raises(ValueError):
        deal(one_sel, 2)


def test_draws_stop_at_the_limit_and_nothing_varied_selects_nothing():
    flat = [
        draw({"A": [1, 1], "B": [0, 0], "C": [1, 1], "D": [0, 0]}, resp_len=3, seed=20 + k)
        for k in range(4)
    ]
    for dp in (1, 2):
        facts, selected, _ = run_rule(flat, dp=dp, target=4, max_draws=3)
        assert len(facts) == 3 and selected == [] and groups_drawn(facts) == 12


def step_batches(
    draws: list[Draw], metrics: list[StepMetrics] | None = None
) -> Callable[[], tuple[StepBatch, StepMetrics]]:
    """A ``draw`` for filter_groups: the next of ``draws`` as a StepBatch (one process), with
    the next of ``metrics`` as the draw's own metrics (none if not given)."""
    it = iter(draws)
    own = iter(metrics if metrics is not None else [{} for _ in draws])

    def next_batch() -> tuple[StepBatch, StepMetrics]:
        samples, scores, reasons = next(it)
        batch = StepBatch(samples, scores, list(reasons), {"reward/mean": float(scores.mean())})
        return batch, next(own)

    return next_batch


def test_filter_groups_trains_the_first_varied_groups_and_logs_the_step():
    verdicts: list[bool] = []
    algorithm = AlgorithmConfig(filter_groups=True, filter_groups_max_batches=3)
    batch, m = filter_groups(step_batches(THREE_DRAWS), algorithm, 4, 0, verdicts.append)
    assert verdicts == [True, False]  # two draws, the second enough
    assert list(dict.fromkeys(batch.samples.group_ids)) == [(0, "C"), (0, "D"), (1, "E"), (1, "G")]
    assert batch.scores.tolist() == pytest.approx([0, 1, 1, 0, 0, 1, 0.2, 0.9])
    logged = {k: v.value for k, v in m.items()}
    drawn = torch.cat([THREE_DRAWS[0][1], THREE_DRAWS[1][1]])
    assert logged == pytest.approx(
        {
            "dynamic_sampling/batches": 2.0,
            "dynamic_sampling/groups_drawn": 8.0,
            "dynamic_sampling/groups_kept": 5.0,
            "dynamic_sampling/groups_trained": 4.0,
            "dynamic_sampling/reward_mean_drawn": float(drawn.mean()),
            "dynamic_sampling/unfiltered": 0.0,
            "dynamic_sampling/filled": 1.0,
        }
    )
    means = [float(THREE_DRAWS[k][1].mean()) for k in (0, 1)]
    assert batch.reward_metrics == pytest.approx({"reward/mean": sum(means) / 2})


def test_filter_groups_falls_back_to_the_last_draw_when_nothing_varied():
    flat = [
        draw({"A": [1, 1], "B": [0, 0]}, resp_len=3, seed=30),
        draw({"C": [1, 1], "D": [0, 0]}, resp_len=4, seed=31),
    ]
    algorithm = AlgorithmConfig(filter_groups=True, filter_groups_max_batches=2)
    batch, m = filter_groups(step_batches(flat), algorithm, 2, 0)
    assert batch.samples is flat[1][0] and batch.scores is flat[1][1]  # as drawn
    assert m["dynamic_sampling/unfiltered"].value == 1.0
    assert m["dynamic_sampling/groups_trained"].value == 2.0
    assert m["dynamic_sampling/filled"].value == 0.0


def test_filter_groups_sums_the_draws_timings_and_keeps_their_last_other_metrics():
    # three draws, each with its timings and memory moves (as trainer.rollout.draw returns);
    # the step's: each timing summed over the draws, every other metric the last draw's
    own = [
        {"timing/rollout_s": mean(0.25), "timing/reward_s": mean(0.5), "hybrid/b": mean(1.0)},
        {"timing/rollout_s": mean(0.75), "hybrid/b": mean(2.0), "offload/a": maximum(3.0)},
        {"timing/rollout_s": mean(1.5), "timing/reward_s": mean(0.125), "hybrid/b": mean(4.0)},
    ]
    algorithm = AlgorithmConfig(filter_groups=True, filter_groups_max_batches=3)
    _, m = filter_groups(step_batches(THREE_DRAWS, own), algorithm, 6, 0)
    assert m["dynamic_sampling/batches"].value == 3.0  # all three drawn
    assert m["timing/rollout_s"] == mean(0.25 + 0.75 + 1.5)
    assert m["timing/reward_s"] == mean(0.5 + 0.125)
    assert m["hybrid/b"] == mean(4.0)
    assert m["offload/a"] == maximum(3.0)  # from the one draw that reported it


def test_overlong_penalty_follows_the_dapo_paper():
    lengths = torch.tensor([10, 12, 14, 16, 20])
    # L_max = 16, buffer 4: no penalty up to 12, then linear to -1 at 16, -1 beyond
    p = overlong_penalty(lengths, max_length=16, buffer_length=4, penalty_factor=1.0)
    assert p.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    p = overlong_penalty(lengths, max_length=16, buffer_length=4, penalty_factor=0.5)
    assert p.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError):
        overlong_penalty(lengths, max_length=16, buffer_length=0, penalty_factor=1.0)
