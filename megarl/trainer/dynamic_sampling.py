"""DAPO's dynamic sampling (``algorithm.filter_groups``): a filter around the step's rollout.

Dynamic sampling (Yu et al. 2025) drops the prompt groups whose samples all got the same reward:
under a group estimator their advantages are all 0, so they only dilute the batch. Further batches
of prompts are drawn (each one a whole rollout: :func:`megarl.trainer.rollout.draw`), at most
``algorithm.filter_groups_max_batches`` per step, until every data-parallel rank holds its share
of ``data.train_batch_size`` prompt groups; the surplus is cut (whole groups, in draw order). When
the limit is reached first, the step trains on the groups every rank has (the smallest count over
ranks, so ranks take the same number of optimizer steps); when some rank kept none, the step
trains on the last draw as it is (under a group estimator its advantages are 0: only the KL and
entropy terms act; logged as ``dynamic_sampling/unfiltered``). ``dynamic_sampling/*`` metrics log
what was drawn, kept and trained (group counts summed over data-parallel ranks); the reward
metrics are the draws' means. The actor scores only what is kept, after the filter. Every draw
reshards the (unchanged) weights into the rollout engine again through ``to_rollout``: simple, and
on CPU cheap; on GPUs it costs one reshard per extra draw. In asynchronous training the draws come
from the rollout group, which learns after each one whether another is wanted (``decided``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl import platform
from megarl.config import AlgorithmConfig
from megarl.metrics import StepMetrics, declare
from megarl.trainer.batch import Samples, StepBatch
from megarl.trainer.dp_collectives import dp_sum


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

    keys = set(pieces[0].tensors)
    return Samples(
        input_ids=torch.cat([pad(p.input_ids, width, pad_id) for p in pieces]),
        prompt_lens=torch.cat([p.prompt_lens for p in pieces]),
        response_lens=torch.cat([p.response_lens for p in pieces]),
        group_ids=[g for p in pieces for g in p.group_ids],
        response_mask=torch.cat([pad(p.response_mask, resp, 0.0) for p in pieces]),
        tensors={k: torch.cat([pad(p.tensors[k], resp, 0.0) for p in pieces]) for k in keys},
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
    """The kept groups of one rank's draws so far, and the counts dynamic sampling logs."""

    target_groups: int
    pieces: list[Samples] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    draws: int = 0
    groups_drawn: int = 0
    groups_kept: int = 0
    drawn_score_sum: float = 0.0
    drawn_samples: int = 0

    def add(self, samples: Samples, scores: torch.Tensor, finish_reasons: Sequence[str]) -> None:
        """One draw: keep its groups whose scores vary. Group ids become ``(draw, id)`` so a
        prompt drawn twice (a new epoch) forms two groups."""
        draw = self.draws
        self.draws += 1
        self.groups_drawn += len(dict.fromkeys(samples.group_ids))
        self.drawn_score_sum += float(scores.sum())
        self.drawn_samples += int(scores.numel())
        keep = varied_groups(samples.group_ids, scores)
        self.groups_kept += len(keep)
        if not keep:
            return
        rows = rows_of(samples.group_ids, keep)
        piece = samples.select(rows)
        piece.group_ids = [(draw, g) for g in piece.group_ids]
        self.pieces.append(piece)
        self.scores.append(scores[rows])
        self.finish_reasons += [finish_reasons[r] for r in rows]

    def take(self, groups: int, pad_id: int) -> tuple[Samples, torch.Tensor, list[str]]:
        """The first ``groups`` kept groups (all rows of each), in draw order."""
        merged = concat_samples(self.pieces, pad_id)
        order = list(dict.fromkeys(merged.group_ids))[:groups]
        rows = rows_of(merged.group_ids, order)
        scores = torch.cat(self.scores)[rows]
        return merged.select(rows), scores, [self.finish_reasons[r] for r in rows]

    def metrics(self, trained_groups: int) -> dict[str, float]:
        return {
            "dynamic_sampling/batches": float(self.draws),
            "dynamic_sampling/groups_drawn": float(self.groups_drawn),
            "dynamic_sampling/groups_kept": float(self.groups_kept),
            "dynamic_sampling/groups_trained": float(trained_groups),
            "dynamic_sampling/reward_mean_drawn": self.drawn_score_sum / max(self.drawn_samples, 1),
        }


def _world_min(value: int) -> int:
    t = torch.tensor([float(value)], device=platform.collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def filter_groups(
    draw: Callable[[], StepBatch],
    algorithm: AlgorithmConfig,
    target_groups: int,
    pad_id: int,
    m: StepMetrics,
    decided: Callable[[bool], None] | None = None,
) -> StepBatch:
    """Draws of ``draw`` (a rollout of the next prompts, rewarded) until every rank holds
    ``target_groups`` prompt groups whose rewards vary, or ``algorithm.filter_groups_max_batches``
    draws; the kept groups as one batch. ``decided(more)`` hears after each draw, on every rank,
    whether another follows. The ``dynamic_sampling/*`` counts go into ``m``."""
    pool = GroupPool(target_groups=target_groups)
    sums: dict[str, float] = {}  # reward metrics, averaged over the draws
    while True:
        batch = draw()
        pool.add(batch.samples, batch.scores, batch.finish_reasons)
        for k, v in batch.reward_metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        have = _world_min(pool.groups_kept)
        full = have >= pool.target_groups or pool.draws >= algorithm.filter_groups_max_batches
        if decided is not None:
            decided(not full)
        if full:
            break
    groups = min(have, pool.target_groups)
    stats = pool.metrics(groups)
    samples, scores, reasons = batch.samples, batch.scores, batch.finish_reasons
    if groups > 0:
        samples, scores, reasons = pool.take(groups, pad_id)
    else:  # some rank kept nothing: the last draw as it is (zero advantages under grpo)
        stats["dynamic_sampling/groups_trained"] = float(len(dict.fromkeys(samples.group_ids)))
    stats["dynamic_sampling/unfiltered"] = float(groups == 0)
    # group counts over data-parallel ranks (every rank of a DP rank holds the same)
    counts = [k for k in stats if k.startswith("dynamic_sampling/groups")]
    values = [stats[k] for k in counts]
    totals = dp_sum(torch.tensor(values, dtype=torch.float64, device=platform.collective_device()))
    stats.update(zip(counts, totals.tolist(), strict=True))
    stats["dynamic_sampling/filled"] = float(groups >= pool.target_groups)
    m.update(declare(stats))
    averaged = {k: v / pool.draws for k, v in sums.items()}
    return StepBatch(samples, scores, list(reasons), averaged)
