"""Which prompt groups a step of DAPO's dynamic sampling trains: one rule for the whole step, so
that a run trains the same groups at any data-parallel layout.

Every draw is a rollout of the step's next prompts, each DP rank holding its contiguous part of
them (DP rank order is prompt order). A group is numbered by its draw and its *global* index in
that draw: the groups of lower DP ranks first, then this rank's in order of first appearance.
Each DP rank reports, per draw, which of its groups are varied (their samples' scores are not all
equal) in a :class:`DrawFacts`; every rank gathers every rank's facts and so takes the same
decisions from them:

- after each draw, whether another is wanted (:func:`wants_more`): while fewer than the step's
  prompt count of varied groups have been drawn and the draw limit is not reached;
- which groups the step trains (:func:`select`): the first ``target`` varied groups in (draw,
  index) order, cut to a multiple of the DP size so that every rank trains as many; none selected
  means the step falls back to its last draw as it is;
- which rank trains which (:func:`deal`): contiguous slices of the selection in DP rank order.

One process sees the same numbering (its only rank holds the whole draw), so a DP1 and a DP2 run
of the same prompts select the same groups, in the same order. Pure functions of the facts: no
collectives here (:mod:`megarl.trainer.dynamic_sampling` gathers the facts and moves the rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DrawFacts:
    """One DP rank's part of one draw: per group (in order of first appearance) whether its scores
    vary, and the part's score sum and sample count (for the drawn reward mean)."""

    varied: tuple[bool, ...]
    score_sum: float
    samples: int


@dataclass(frozen=True)
class GroupRef:
    """One group of a step's draws: ``draw`` and ``index`` (its global index in the draw) order
    the groups; ``rank`` (the DP rank that drew it) and ``local`` (its index among that rank's
    groups of the draw) find its rows."""

    draw: int
    index: int
    rank: int
    local: int


# A step's facts so far: draws[d][r] is DP rank r's part of draw d.
StepFacts = Sequence[Sequence[DrawFacts]]


def numbered(draw: int, parts: Sequence[DrawFacts]) -> list[tuple[GroupRef, bool]]:
    """Every group of draw ``draw`` (``parts``: each DP rank's, in rank order) with whether it is
    varied, in global index order."""
    out: list[tuple[GroupRef, bool]] = []
    for rank, part in enumerate(parts):
        for local, varied in enumerate(part.varied):
            out.append((GroupRef(draw, len(out), rank, local), varied))
    return out


def kept_groups(draws: StepFacts) -> list[GroupRef]:
    """The varied groups of all draws, in (draw, global index) order."""
    return [ref for d, parts in enumerate(draws) for ref, varied in numbered(d, parts) if varied]


def groups_drawn(draws: StepFacts) -> int:
    return sum(len(part.varied) for parts in draws for part in parts)


def reward_mean_drawn(draws: StepFacts) -> float:
    """The mean score of every sample drawn (0 when nothing was)."""
    samples = sum(part.samples for parts in draws for part in parts)
    return sum(part.score_sum for parts in draws for part in parts) / max(samples, 1)


def wants_more(draws: StepFacts, target: int, max_draws: int) -> bool:
    """Whether the step draws again: fewer than ``target`` varied groups and fewer than
    ``max_draws`` draws so far."""
    return len(kept_groups(draws)) < target and len(draws) < max_draws


def select(draws: StepFacts, target: int, dp_size: int) -> list[GroupRef]:
    """The groups the step trains: the first ``target`` varied ones, cut to a multiple of
    ``dp_size`` (whole groups from the end); empty when fewer than ``dp_size`` are varied."""
    kept = kept_groups(draws)[:target]
    return kept[: len(kept) - len(kept) % dp_size]


def deal(selected: Sequence[GroupRef], dp_size: int) -> list[list[GroupRef]]:
    """``selected`` (a multiple of ``dp_size`` long) in ``dp_size`` contiguous slices, one a DP
    rank in rank order."""
    if len(selected) % dp_size:
        raise ValueError(f"{len(selected)} groups cannot be dealt evenly to {dp_size} DP ranks")
    share = len(selected) // dp_size
    return [list(selected[r * share : (r + 1) * share]) for r in range(dp_size)]
