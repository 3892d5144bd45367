"""Where a Ray job's ranks go: pure rank arithmetic over the cluster's nodes.

A node offers ``usable`` rank slots (its GPUs, or on a CPU cluster its CPUs, less the slots where
earlier attempts' ranks failed). Ranks are packed onto as few nodes as hold them, the driver's
node first among equals; they are numbered node by node, so that consecutive ranks (a TP group)
share a node, and rank 0 (the rendezvous) is on the first.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeSlots:
    node_id: str
    ip: str
    slots: int  # rank slots the node holds in all


def usable(nodes: Sequence[NodeSlots], lost: Sequence[Hashable]) -> list[tuple[NodeSlots, int]]:
    """Each node with the slots left after ``lost`` (node ids, one entry per failed slot)."""
    return [(n, max(0, n.slots - list(lost).count(n.node_id))) for n in nodes]


def capacity(nodes: Sequence[NodeSlots], lost: Sequence[Hashable], one_node: bool) -> int:
    free = [k for _, k in usable(nodes, lost)]
    return max(free, default=0) if one_node else sum(free)


def plan(
    nodes: Sequence[NodeSlots],
    lost: Sequence[Hashable],
    world: int,
    one_node: bool,
    first: str | None = None,
) -> list[tuple[NodeSlots, int]] | None:
    """(node, ranks on it) in rank order, or None when the nodes cannot hold ``world`` ranks.
    ``first``: the node id preferred among nodes with as many free slots (the driver's)."""
    free = [(n, k) for n, k in usable(nodes, lost) if k > 0]
    free.sort(key=lambda nk: (-nk[1], nk[0].node_id != first, nk[0].node_id))
    if one_node:
        return [(free[0][0], world)] if free and free[0][1] >= world else None
    out, left = [], world
    for node, k in free:
        if left == 0:
            break
        take = min(k, left)
        out.append((node, take))
        left -= take
    return out if left == 0 else None


def rank_table(placed: Sequence[tuple[NodeSlots, int]]) -> list[tuple[NodeSlots, int]]:
    """(node, local rank) of every global rank, in rank order."""
    return [(node, local) for node, count in placed for local in range(count)]


def visible_devices(gpu_ids: Mapping[int, str], ranks_on_node: Sequence[int]) -> list[str]:
    """The GPUs of a node's ranks in ``CUDA_VISIBLE_DEVICES`` order (each rank's ``LOCAL_RANK``
    is its own GPU's index here), sorted as the node numbers them."""
    return sorted((gpu_ids[r] for r in ranks_on_node), key=lambda g: (len(g), g))
