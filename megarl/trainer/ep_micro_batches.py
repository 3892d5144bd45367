"""Equal micro-batch counts over the data-parallel ranks of an expert-parallel model.

With EP > 1 every forward pass of an MoE layer runs an all-to-all over the EP group, which spans
data-parallel ranks: each of them must run the same number of micro-batches per schedule, or
the collectives pair up wrongly and the job hangs. A token budget
(``actor.max_tokens_per_micro_batch``) gives each rank its own count; the ranks agree on the
largest one and split their largest micro-batches until they have as many.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megarl import parallel, platform
from megarl.trainer.batch import Samples, micro_batches


def split_to_count(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` with the largest one halved (order kept) until there are ``count`` of them."""
    out = [list(g) for g in groups]
    while len(out) < count:
        i = max(range(len(out)), key=lambda j: len(out[j]))
        if len(out[i]) < 2:
            raise ValueError(f"{sum(map(len, out))} rows cannot make {count} micro-batches")
        half = len(out[i]) // 2
        out[i : i + 1] = [out[i][:half], out[i][half:]]
    return out


def _dp_max(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=platform.collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=parallel.dp_group())
    return int(t.item())


def aligned_micro_batches(
    samples: Samples,
    rows: Sequence[int],
    micro_batch_size: int,
    max_tokens: int | None = None,
    packed: bool = False,
    groups_together: bool = False,
) -> list[tuple[list[int], Samples]]:
    """:func:`megarl.trainer.batch.micro_batches`, with as many micro-batches on every
    data-parallel rank when experts are split over them (a collective then)."""
    mbs = micro_batches(samples, rows, micro_batch_size, max_tokens, packed, groups_together)
    if parallel.ep_size() == 1:
        return mbs
    count = _dp_max(len(mbs))
    if count == len(mbs):
        return mbs
    groups = split_to_count([g for g, _ in mbs], count)
    return [(g, samples.select(g)) for g in groups]
