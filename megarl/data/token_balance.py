"""Assign sequence groups to data-parallel ranks so that each rank gets about the same tokens.

Rollout lengths have a long tail: cut the batch into equal row counts and one rank may get
several long responses while another idles at the gradient all-reduce. The unit of assignment is
a *group* (all samples of one prompt: GRPO/RLOO advantages are computed inside a group, so a
group never spans ranks); every rank gets the same number of groups, so each runs the same
number of micro-batches.

Two deterministic assignments are computed and the one with the smaller heaviest rank kept:

- greedy (longest processing time first): groups by decreasing tokens, each to the lightest rank
  that still has room;
- serpentine: groups by decreasing tokens dealt in rounds of ``ranks``, the direction reversing
  every round. Within a round the ranks' loads differ by at most (first - last) of that round;
  summed over rounds this telescopes to at most the largest group.

The kept plan is then refined by swaps between the heaviest and the lightest rank while a swap
lowers the heaviest one (never raises it, so the bound stands).

Hence the guarantee tested in tests/unit/test_token_balance.py: heaviest rank <= mean + largest
group (equal group counts per rank). The result is a pure function of the lengths, so every rank
computes the same plan from all-gathered lengths without further communication.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Assignment:
    """``ranks[r]``: the group indices rank r gets (ascending); ``tokens[r]``: their tokens."""

    ranks: tuple[tuple[int, ...], ...]
    tokens: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        """Heaviest rank's tokens over the mean, minus one (0: perfectly even)."""
        return imbalance(self.tokens)


def imbalance(rank_tokens: Sequence[int | float]) -> float:
    """max / mean - 1 of per-rank token counts (the metric a step reports); 0 for no tokens."""
    total = sum(rank_tokens)
    if not rank_tokens or total <= 0:
        return 0.0
    return max(rank_tokens) * len(rank_tokens) / total - 1.0


def _order(group_tokens: Sequence[int]) -> list[int]:
    # Decreasing tokens, ties by index: the same order on every rank.
    return sorted(range(len(group_tokens)), key=lambda i: (-group_tokens[i], i))


def _greedy(group_tokens: Sequence[int], ranks: int, per_rank: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(ranks)]
    heap = [(0, r) for r in range(ranks)]  # (load, rank); full ranks leave the heap
    for i in _order(group_tokens):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        if len(out[r]) < per_rank:
            heapq.heappush(heap, (load + group_tokens[i], r))
    return out


def _serpentine(group_tokens: Sequence[int], ranks: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(ranks)]
    for pos, i in enumerate(_order(group_tokens)):
        round_, k = divmod(pos, ranks)
        out[k if round_ % 2 == 0 else ranks - 1 - k].append(i)
    return out


def _refine(group_tokens: Sequence[int], plan: list[list[int]], rounds: int = 1000):
    """Swap one group of the heaviest rank for a lighter one of the lightest rank, the swap that
    brings the two closest to even, while that lowers the heavier of the two."""
    loads = [sum(group_tokens[i] for i in rank) for rank in plan]
    for _ in range(rounds):
        h = max(range(len(plan)), key=lambda r: (loads[r], -r))
        lo = min(range(len(plan)), key=lambda r: (loads[r], r))
        gap = loads[h] - loads[lo]
        best: tuple[int, int, int] | None = None  # (new max of the two, index in h, in lo)
        for a, i in enumerate(plan[h]):
            for b, j in enumerate(plan[lo]):
                d = group_tokens[i] - group_tokens[j]
                if 0 < d < gap:
                    new_max = max(loads[h] - d, loads[lo] + d)
                    if best is None or new_max < best[0]:
                        best = (new_max, a, b)
        if best is None:
            break
        _, a, b = best
        i, j = plan[h][a], plan[lo][b]
        plan[h][a], plan[lo][b] = j, i
        d = group_tokens[i] - group_tokens[j]
        loads[h] -= d
        loads[lo] += d
    return plan


def balance_groups(group_tokens: Sequence[int], ranks: int) -> Assignment:
    """Assign groups (their token counts) to ``ranks`` data-parallel ranks, the same number of
    groups each, minimising the heaviest rank's tokens (see the module doc for the bound)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if len(group_tokens) % ranks:
        raise ValueError(
            f"{len(group_tokens)} groups cannot be split evenly over {ranks} data-parallel "
            "ranks: the prompts per step must be a multiple of the data-parallel size"
        )
    if any(t < 0 for t in group_tokens):
        raise ValueError("token counts must be >= 0")
    per_rank = len(group_tokens) // ranks
    best: tuple[int, list[list[int]]] | None = None
    for plan in (_greedy(group_tokens, ranks, per_rank), _serpentine(group_tokens, ranks)):
        heaviest = max(sum(group_tokens[i] for i in rank) for rank in plan)
        if best is None or heaviest < best[0]:
            best = (heaviest, plan)
    assert best is not None
    plan = _refine(group_tokens, best[1])
    plan = [sorted(rank) for rank in plan]
    return Assignment(
        ranks=tuple(tuple(rank) for rank in plan),
        tokens=tuple(sum(group_tokens[i] for i in rank) for rank in plan),
    )
