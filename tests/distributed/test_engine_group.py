"""An engine's ranks share its first rank's results (megarl.rollout.engine_group), as the
multi-turn rollout of the colocated engine and of the asynchronous rollout group do: 6 gloo ranks
in engines of 3 (and of 1), every rank gets its own engine's first rank's value, never another
engine's."""

from __future__ import annotations

import torch.distributed as dist

from tests.mp import run_gloo


def _share_worker(rank: int, world: int, infer_tp: int) -> tuple[list[int] | None, str]:
    from megarl.rollout.engine_group import engine_group, share_from_first

    group = engine_group(world, infer_tp, rank)
    members = None if group is None else sorted(dist.get_process_group_ranks(group))
    first = rank - rank % infer_tp
    # the first rank of an engine holds the value, the others None (as run_trajectories passes)
    shared = share_from_first(f"from {rank}" if rank == first else None, group)
    return members, shared


def test_each_engine_shares_its_first_ranks_value_with_its_own_ranks_only():
    results = run_gloo(_share_worker, 6, 3, timeout=300)
    assert [m for m, _ in results] == [[0, 1, 2]] * 3 + [[3, 4, 5]] * 3
    assert [s for _, s in results] == ["from 0"] * 3 + ["from 3"] * 3
    # engines of one rank: no group, each rank keeps its own value
    singles = run_gloo(_share_worker, 2, 1, timeout=300)
    assert singles == [(None, "from 0"), (None, "from 1")]
