"""DAPO's dynamic sampling (``algorithm.filter_groups``): a filter around the step's rollout.

Dynamic sampling (Yu et al. 2025) drops the prompt groups whose samples all got the same reward:
under a group estimator their advantages are all 0, so they only dilute the batch. Further batches
of prompts are drawn (each one a whole rollout: :func:`megarl.trainer.rollout.draw`), at most
``algorithm.filter_groups_max_batches`` per step, until ``data.train_batch_size`` varied prompt
groups have been drawn; the step trains the first ``data.train_batch_size`` of them in draw order
(the surplus is cut, whole groups). The rule is the whole step's, not each data-parallel rank's
(:mod:`megarl.trainer.group_selection`): every DP rank shares which of its groups vary, all take
the same decisions, and the selected groups are dealt to the DP ranks in contiguous slices, their
rows moved between ranks where a slice holds another rank's groups; so a run trains the same
groups at any layout. When the limit is reached first, the step trains the varied groups drawn
(cut to a multiple of the DP size, so ranks train as many); when there are none, the step trains
on the last draw as it is (under a group estimator its advantages are 0: only the KL and entropy
terms act; logged as ``dynamic_sampling/unfiltered``). ``dynamic_sampling/*`` metrics log what
was drawn, kept and trained (group counts of the whole step, over every DP rank); the reward
metrics are the draws' means. The actor scores only what is kept, after the filter. Every draw
reshards the (unchanged) weights into the rollout engine again through ``to_rollout``: simple, and
on CPU cheap; on GPUs it costs one reshard per extra draw. In asynchronous training the draws come
from the rollout group, which learns after each one whether another is wanted (``decided``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from megarl import parallel
from megarl.config import AlgorithmConfig
from megarl.metrics import StepMetrics, declare
from megarl.run.steps import merge_repeated
from megarl.trainer.batch import Samples, StepBatch
from megarl.trainer.dp_balance import HostRow, host_rows, samples_of_rows
from megarl.trainer.dp_collectives import dp_exchange, dp_gather
from megarl.trainer.group_selection import (
    DrawFacts,
    GroupRef,
    deal,
    groups_drawn,
    kept_groups,
    numbered,
    reward_mean_drawn,
    select,
    wants_more,
)
from megarl.trainer.token_tensors import TokenTensors

# A group of one rank's pool: (draw, its index among the rank's groups of that draw).
LocalGroup = tuple[int, int]


def varied_groups(group_ids: Sequence[Hashable], scores: torch.Tensor) -> list[Hashable]:
    """The groups, in order of first appearance, whose scores are not all equal."""
    seen: dict[Hashable, tuple[float, bool]] = {}
    for g, s in zip(group_ids, scores.tolist(), strict=True):
        first, varied = seen.get(g, (s, False))
        seen[g] = (first, varied or s != first)
    return [g for g, (_, varied) in seen.items() if varied]


def rows_of(group_ids: Sequence[Hashable], groups: Sequence[Hashable]) -> list[int]:
    wanted = set(groups)
    return [i for i, g in enumerate(group_ids) if g in wanted]


def concat_samples(pieces: Sequence[Samples], pad_id: int) -> Samples:
    """Rows of several Samples in one, padded to the longest sequence and response."""
    width = max(int(p.input_ids.shape[1]) for p in pieces)
    resp = max(int(p.response_mask.shape[1]) for p in pieces)

    def pad(t: torch.Tensor, to: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, to - t.shape[1]), value=value)

    return Samples(
        input_ids=torch.cat([pad(p.input_ids, width, pad_id) for p in pieces]),
        prompt_lens=torch.cat([p.prompt_lens for p in pieces]),
        response_lens=torch.cat([p.response_lens for p in pieces]),
        group_ids=[g for p in pieces for g in p.group_ids],
        response_mask=torch.cat([pad(p.response_mask, resp, 0.0) for p in pieces]),
        tensors=TokenTensors.concat([p.tensors for p in pieces], resp),
        routes=_concat_routes([p.routes for p in pieces], width),
    )


def _concat_routes(routes: Sequence[torch.Tensor | None], width: int) -> torch.Tensor | None:
    """The pieces' recorded experts (actor.router_replay) in one tensor, -1 past each end."""
    if any(r is None for r in routes):
        return None
    pieces = [r for r in routes if r is not None]
    return torch.cat(
        [torch.nn.functional.pad(r, (0, 0, 0, 0, 0, width - r.shape[1]), value=-1) for r in pieces]
    )


@dataclass
class GroupPool:
    """This rank's varied groups of the step's draws so far (all their rows), each found by its
    draw and its index among this rank's groups of that draw."""

    pieces: list[Samples] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    ids: dict[LocalGroup, Hashable] = field(default_factory=dict)  # its group id in ``pieces``
    draws: int = 0

    def add(
        self, samples: Samples, scores: torch.Tensor, finish_reasons: Sequence[str]
    ) -> DrawFacts:
        """One draw: keep its groups whose scores vary; what the other ranks need to know of it.
        Group ids become ``(draw, id)`` so a prompt drawn twice (a new epoch) forms two groups."""
        draw = self.draws
        self.draws += 1
        groups = list(dict.fromkeys(samples.group_ids))
        keep = set(varied_groups(samples.group_ids, scores))
        facts = DrawFacts(tuple(g in keep for g in groups), float(scores.sum()), scores.numel())
        if not keep:
            return facts
        rows = rows_of(samples.group_ids, list(keep))
        piece = samples.select(rows)
        piece.group_ids = [(draw, g) for g in piece.group_ids]
        self.pieces.append(piece)
        self.scores.append(scores[rows])
        self.finish_reasons += [finish_reasons[r] for r in rows]
        self.ids.update({(draw, i): (draw, g) for i, g in enumerate(groups) if g in keep})
        return facts

    def take(
        self, groups: Sequence[LocalGroup], pad_id: int
    ) -> tuple[Samples, torch.Tensor, list[str]]:
        """All rows of ``groups`` (kept ones), group after group in the order given."""
        merged = concat_samples(self.pieces, pad_id)
        position = {self.ids[g]: i for i, g in enumerate(groups)}
        ids = merged.group_ids
        rows = sorted(
            (r for r, g in enumerate(ids) if g in position), key=lambda r: (position[ids[r]], r)
        )
        scores = torch.cat(self.scores)[rows]
        return merged.select(rows), scores, [self.finish_reasons[r] for r in rows]


# The rows (and finish reasons) of the selected groups a DP rank holds, by (draw, global index).
Package = dict[tuple[int, int], tuple[list[HostRow], list[str]]]


def package(pool: GroupPool, held: Sequence[GroupRef], pad_id: int) -> Package:
    """The rows of ``held`` (selected groups this rank drew) as host records, to send."""
    if not held:
        return {}
    samples, scores, reasons = pool.take([(g.draw, g.local) for g in held], pad_id)
    key = {pool.ids[(g.draw, g.local)]: (g.draw, g.index) for g in held}
    out: Package = {}
    for i, row in enumerate(host_rows(samples, scores)):
        rows, row_reasons = out.setdefault(key[samples.group_ids[i]], ([], []))
        rows.append(row)
        row_reasons.append(reasons[i])
    return out


def outgoing_packages(
    pool: GroupPool, selected: Sequence[GroupRef], dp_size: int, rank: int, pad_id: int
) -> list[Package]:
    """What DP rank ``rank`` sends each DP rank: the rows of the selected groups it drew that
    fall in that rank's slice (:func:`~megarl.trainer.group_selection.deal`); its own slice's
    rows stay with it (the entry for ``rank``)."""
    held = package(pool, [g for g in selected if g.rank == rank], pad_id)
    return [
        {(g.draw, g.index): held[(g.draw, g.index)] for g in part if g.rank == rank}
        for part in deal(selected, dp_size)
    ]


def assemble(
    packages: Sequence[Package], groups: Sequence[GroupRef], pad_id: int, device: torch.device
) -> tuple[Samples, torch.Tensor, list[str]]:
    """The rows of ``groups`` (one rank's slice), group after group, from what every rank sent
    this one (:func:`outgoing_packages`, in DP rank order)."""
    parts = [packages[g.rank][(g.draw, g.index)] for g in groups]
    rows = [row for part_rows, _ in parts for row in part_rows]
    reasons = [reason for _, part_reasons in parts for reason in part_reasons]
    scores = torch.stack([row["score"] for row in rows]).to(device)
    return samples_of_rows(rows, pad_id, device), scores, reasons


def share_of_selection(
    pool: GroupPool,
    selected: Sequence[GroupRef],
    dp_size: int,
    pad_id: int,
    device: torch.device,
) -> tuple[Samples, torch.Tensor, list[str]]:
    """This DP rank's slice of ``selected`` (:func:`~megarl.trainer.group_selection.deal`): its
    samples, scores and finish reasons, the rows of groups another rank drew moved here (a
    collective over the DP group when ``dp_size`` > 1: each rank sends each other rank only the
    rows of its slice, so no rank holds more than its own rows and its slice's)."""
    if dp_size == 1:
        return pool.take([(g.draw, g.local) for g in selected], pad_id)
    rank = parallel.dp_rank()
    received = dp_exchange(outgoing_packages(pool, selected, dp_size, rank, pad_id))
    return assemble(received, deal(selected, dp_size)[rank], pad_id, device)


def filter_groups(
    draw: Callable[[], tuple[StepBatch, StepMetrics]],
    algorithm: AlgorithmConfig,
    target_groups: int,
    pad_id: int,
    decided: Callable[[bool], None] | None = None,
) -> tuple[StepBatch, StepMetrics]:
    """Draws of ``draw`` (a rollout of this DP rank's part of the next prompts, rewarded) until
    ``target_groups`` prompt groups over all DP ranks (the step's) have rewards that vary, or
    ``algorithm.filter_groups_max_batches`` draws; this rank's share of the selected groups as
    one batch. ``decided(more)`` hears after each draw, on every rank, whether another follows.
    Also the step's metrics: the draws' own (:func:`~megarl.run.steps.merge_repeated`: their
    timings summed) and the ``dynamic_sampling/*`` counts."""
    pool = GroupPool()
    facts: list[list[DrawFacts]] = []  # facts[d][r]: DP rank r's part of draw d
    sums: dict[str, float] = {}  # reward metrics, averaged over the draws
    drawn: StepMetrics = {}  # the draws' metrics, their timings summed
    while True:
        batch, metrics = draw()
        drawn = merge_repeated(drawn, metrics)
        facts.append(dp_gather(pool.add(batch.samples, batch.scores, batch.finish_reasons)))
        for k, v in batch.reward_metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        more = wants_more(facts, target_groups, algorithm.filter_groups_max_batches)
        if decided is not None:
            decided(more)
        if not more:
            break
    dp_size = len(facts[0])
    selected = select(facts, target_groups, dp_size)
    samples, scores, reasons = batch.samples, batch.scores, list(batch.finish_reasons)
    trained = len(selected)
    if selected:
        device = batch.samples.input_ids.device
        samples, scores, reasons = share_of_selection(pool, selected, dp_size, pad_id, device)
    else:  # no group (or fewer than DP ranks) varied: the last draw as it is
        trained = len(numbered(len(facts) - 1, facts[-1]))
    stats = {  # the whole step's, the same on every rank
        "dynamic_sampling/batches": float(len(facts)),
        "dynamic_sampling/groups_drawn": float(groups_drawn(facts)),
        "dynamic_sampling/groups_kept": float(len(kept_groups(facts))),
        "dynamic_sampling/groups_trained": float(trained),
        "dynamic_sampling/reward_mean_drawn": reward_mean_drawn(facts),
        "dynamic_sampling/unfiltered": float(not selected),
        "dynamic_sampling/filled": float(len(selected) >= target_groups),
    }
    averaged = {k: v / len(facts) for k, v in sums.items()}
    return StepBatch(samples, scores, reasons, averaged), drawn | declare(stats)
