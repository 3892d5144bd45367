"""The reshard planner: which slice of which actor tensor moves from which rank to which, in buckets.

Pure and deterministic: it imports nothing of vLLM, megatron or torch. Every rank computes the same
:class:`ReshardSchedule` from the same inputs and keeps its own ops (:meth:`ReshardSchedule.for_rank`).

Inputs
  - the training layout (TP x PP x DP, megatron's rank order) and the inference layout
    (``layout.rollout_tp``: vLLM TP over consecutive ranks, PP 1);
  - the model's tensor list (:class:`PlannedTensor`: name, full shape, the dimension split over TP
    (None: replicated), the pipeline stage that owns it, bytes per element, and how the rollout
    engine cuts it over its own TP ranks: :class:`ShardRule`). Megatron's fused gate/up weight
    appears as two specs of one ``group`` (gate rows, up rows) so every spec is split as one
    contiguous range per training TP rank;
  - ``mode``: ``"full"`` (every rank needs every tensor whole, for an engine that cuts its own
    TP shard from whole Hugging Face tensors) or ``"shard"`` (each rank needs only the slices its
    inference TP rank loads: HybridFlow's zero-redundancy transition). A rank's need is one or
    more ranges along ``tp_dim`` (:func:`need_ranges`): one for an even split or vLLM's padded
    vocabulary split, two for a query group's attention rows when the rollout TP exceeds the
    KV heads (a share of the group's query heads, and its key/value rows, which those ranks
    replicate);
  - ``bucket_bytes``: the most bytes of destination tensors a rank assembles per bucket (a group
    larger than that travels alone);
  - ``ep`` (mixture of experts): an expert's weights live only on the data-parallel replicas of
    its expert-parallel rank (``PlannedTensor.expert_rank``; megatron's layout puts DP replica ``d``
    on EP rank ``d % ep``), split over TP like the dense tensors (expert TP = TP).

Output: buckets of ops. A ``recv`` on rank B from A always has the matching ``send`` on A to B in
the same bucket, in the same relative order; ``copy`` takes a slice this rank already holds.
Each byte a rank needs arrives exactly once (by ``copy`` when it holds it, else by one ``recv``)
and nothing it does not need is sent to it, so received bytes equal :meth:`ReshardSchedule.min_recv_bytes`.
Sources are spread over the holders of a slice (DP replicas, TP ranks of replicated tensors).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

MODES = ("full", "shard")

Range = tuple[int, int]


@dataclass(frozen=True)
class ShardRule:
    """How the rollout engine cuts a tensor's ``tp_dim`` over its TP ranks (shard mode).

    - ``even``: ``extent / infer_tp`` contiguous rows per rank;
    - ``padded`` (vLLM's vocabulary): the extent is padded to a multiple of ``pad_to`` and split
      evenly; a rank's rows end at the real extent (the last ranks may hold fewer, or none);
    - ``grouped`` (megatron's fused attention rows ``[q heads; k; v]`` per query group): the
      extent is ``groups`` equal units; up to ``groups`` ranks split whole units; beyond that the
      ranks sharing a unit each take an equal part of its first ``unit - shared_rows`` rows (their
      query heads, at multiples of ``head_rows``) and all of its last ``shared_rows`` (the key and
      value heads they replicate).
    """

    kind: str = "even"
    pad_to: int = 1
    groups: int = 0
    shared_rows: int = 0
    head_rows: int = 1


EVEN = ShardRule()
SHARD_RULE_KINDS = ("even", "padded", "grouped")


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the training model as the planner sees it."""

    name: str  # unique key, e.g. the megatron name with the global layer index (+ "#0"/"#1" part)
    shape: tuple[int, ...]
    tp_dim: int | None  # dimension split over training TP (and inference TP); None: replicated
    stage: int  # pipeline stage that holds it
    itemsize: int = 4
    group: str = ""  # specs of one group travel in the same bucket ("" = the name)
    expert_rank: int | None = None  # MoE expert weight: the EP rank holding it (None: every DP)
    shard_rule: ShardRule = EVEN  # how the rollout engine splits tp_dim (shard mode)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def key(self) -> str:
        return self.group or self.name

    def row_bytes(self) -> int:
        """Bytes of one index along ``tp_dim`` (the whole tensor when replicated)."""
        if self.tp_dim is None:
            return self.nbytes
        return self.nbytes // self.shape[self.tp_dim]


@dataclass(frozen=True)
class Slice:
    """``[start, stop)`` of spec ``tensor`` along its ``tp_dim`` (whole tensor when dim is None)."""

    tensor: int
    start: int
    stop: int


@dataclass(frozen=True)
class Op:
    kind: str  # "send" | "recv" | "copy"
    peer: int  # the other rank (this rank for "copy")
    slice: Slice
    nbytes: int


@dataclass
class RankBucket:
    """What one rank does in one bucket: its ops, and the tensors (or shards) it assembles."""

    index: int
    ops: list[Op] = field(default_factory=list)
    # spec index -> the ranges along tp_dim this rank assembles, stacked in this order
    needs: dict[int, tuple[Range, ...]] = field(default_factory=dict)

    @property
    def recv_bytes(self) -> int:
        return sum(op.nbytes for op in self.ops if op.kind == "recv")

    @property
    def send_bytes(self) -> int:
        return sum(op.nbytes for op in self.ops if op.kind == "send")

    def dest_bytes(self, specs: Sequence[PlannedTensor]) -> int:
        return sum(range_length(r) * specs[t].row_bytes() for t, r in self.needs.items())


def range_length(ranges: Sequence[Range]) -> int:
    return sum(b - a for a, b in ranges)


def dest_offset(ranges: Sequence[Range], start: int) -> int:
    """Where global index ``start`` (inside one of ``ranges``) lands in the stacked ranges."""
    offset = 0
    for a, b in ranges:
        if a <= start < b:
            return offset + start - a
        offset += b - a
    raise ValueError(f"index {start} is outside the ranges {list(ranges)}")


@dataclass
class ReshardSchedule:
    tp: int
    pp: int
    dp: int
    infer_tp: int
    mode: str
    bucket_bytes: int
    specs: tuple[PlannedTensor, ...]
    buckets: list[list[int]]  # spec indices per bucket
    ranks: dict[int, list[RankBucket]]
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def for_rank(self, rank: int) -> list[RankBucket]:
        return self.ranks[rank]

    def recv_bytes(self, rank: int) -> int:
        return sum(b.recv_bytes for b in self.ranks[rank])

    def send_bytes(self, rank: int) -> int:
        return sum(b.send_bytes for b in self.ranks[rank])

    def cross_node_recv_bytes(self, rank: int, ranks_per_node: int) -> int:
        """Bytes this rank receives from ranks on other nodes (nodes of ``ranks_per_node``
        consecutive ranks)."""
        node = rank // ranks_per_node
        return sum(
            op.nbytes
            for b in self.ranks[rank]
            for op in b.ops
            if op.kind == "recv" and op.peer // ranks_per_node != node
        )

    def need_bytes(self, rank: int) -> int:
        """Bytes of every tensor (slice) this rank's rollout engine loads."""
        return sum(range_length(need_ranges(s, self, rank)) * s.row_bytes() for s in self.specs)

    def min_recv_bytes(self, rank: int) -> int:
        """Bytes this rank needs and does not hold: the least any plan must deliver to it."""
        return sum(_unheld_bytes(spec, self, rank) for spec in self.specs)

    def peak_dest_bytes(self, rank: int) -> int:
        return max((b.dest_bytes(self.specs) for b in self.ranks[rank]), default=0)

    def peak_inflight_dest_bytes(self, rank: int) -> int:
        """The most destination bytes of two consecutive buckets (the executor assembles the
        next bucket while the rollout engine loads the current one)."""
        sizes = [b.dest_bytes(self.specs) for b in self.ranks[rank]]
        pairs = [a + b for a, b in itertools.pairwise(sizes)]
        return max(pairs or sizes or [0])


def _extent(spec: PlannedTensor) -> int:
    return 1 if spec.tp_dim is None else spec.shape[spec.tp_dim]


def _rank_of(tp: int, dp: int, t: int, d: int, p: int) -> int:
    return t + tp * (d + dp * p)


def _pieces(spec: PlannedTensor, plan: ReshardSchedule) -> dict[Range, list[int]]:
    """Training pieces of a spec: ``(start, stop) -> ranks holding it`` (ordered)."""
    tp, dp, p = plan.tp, plan.dp, spec.stage
    replicas = [d for d in range(dp) if spec.expert_rank is None or d % plan.ep == spec.expert_rank]
    if spec.tp_dim is None:
        return {(0, 1): [_rank_of(tp, dp, t, d, p) for d in replicas for t in range(tp)]}
    n = spec.shape[spec.tp_dim]
    step = n // tp
    return {
        (t * step, (t + 1) * step): [_rank_of(tp, dp, t, d, p) for d in replicas] for t in range(tp)
    }


def _unheld_bytes(spec: PlannedTensor, plan: ReshardSchedule, rank: int) -> int:
    """Bytes of ``spec`` that ``rank`` needs and holds no training piece of."""
    total = 0
    for (a, b), holders in _pieces(spec, plan).items():
        if rank in holders:
            continue
        for lo, hi in need_ranges(spec, plan, rank):
            total += max(0, min(b, hi) - max(a, lo)) * spec.row_bytes()
    return total


def shard_ranges(spec: PlannedTensor, infer_tp: int, infer_rank: int) -> tuple[Range, ...]:
    """The ranges along ``tp_dim`` that inference TP rank ``infer_rank`` loads (its
    :class:`ShardRule`); the whole tensor when replicated."""
    n = _extent(spec)
    rule = spec.shard_rule
    if spec.tp_dim is None or infer_tp == 1:
        return ((0, n),)
    if rule.kind == "padded":
        per = -(-n // rule.pad_to) * rule.pad_to // infer_tp
        return ((min(infer_rank * per, n), min((infer_rank + 1) * per, n)),)
    if rule.kind == "grouped" and infer_tp > rule.groups:
        sharing = infer_tp // rule.groups
        unit = n // rule.groups
        group, part = divmod(infer_rank, sharing)
        own = (unit - rule.shared_rows) // sharing
        base = group * unit
        return (
            (base + part * own, base + (part + 1) * own),
            (base + unit - rule.shared_rows, base + unit),
        )
    step = n // infer_tp
    return ((infer_rank * step, (infer_rank + 1) * step),)


def need_ranges(spec: PlannedTensor, plan: ReshardSchedule, rank: int) -> tuple[Range, ...]:
    """The ranges along ``tp_dim`` a rank needs of a spec (everything in ``full`` mode)."""
    if plan.mode == "full":
        return ((0, _extent(spec)),)
    return shard_ranges(spec, plan.infer_tp, rank % plan.infer_tp)


def _check_shard_rule(spec: PlannedTensor, infer_tp: int) -> str | None:
    """Why the rollout engine cannot cut ``spec`` over ``infer_tp`` ranks (None: it can)."""
    n, rule = spec.shape[spec.tp_dim], spec.shard_rule  # type: ignore[index]
    if rule.kind not in SHARD_RULE_KINDS:
        return f"unknown shard rule {rule.kind!r}"
    if rule.kind == "padded":
        padded = -(-n // rule.pad_to) * rule.pad_to
        if padded % infer_tp:
            return f"padded to {padded}, it does not split into {infer_tp} equal parts"
        return None
    if rule.kind == "grouped":
        groups = rule.groups
        if groups < 1 or n % groups:
            return f"it is not {groups} equal query groups"
        if infer_tp <= groups:
            return (
                None if groups % infer_tp == 0 else f"{groups} query groups over {infer_tp} ranks"
            )
        own = n // groups - rule.shared_rows
        if infer_tp % groups or own % (infer_tp // groups * rule.head_rows):
            return f"{groups} query groups do not split over {infer_tp} ranks at whole heads"
        return None
    return None if n % infer_tp == 0 else f"it does not split into {infer_tp} equal parts"


def check_specs(
    specs: Sequence[PlannedTensor], tp: int, pp: int, infer_tp: int, mode: str, ep: int = 1
) -> None:
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names in the reshard tensor list: {dup}")
    for s in specs:
        if not 0 <= s.stage < pp:
            raise ValueError(f"tensor {s.name}: stage {s.stage} outside the {pp} pipeline stages")
        if s.expert_rank is not None and not 0 <= s.expert_rank < ep:
            raise ValueError(f"tensor {s.name}: expert rank {s.expert_rank} outside ep={ep}")
        if s.tp_dim is None:
            continue
        if s.shape[s.tp_dim] % tp:
            raise ValueError(
                f"tensor {s.name}: dimension {s.tp_dim} of shape {s.shape} does not split into "
                f"{tp} equal parts (training tp={tp})"
            )
        why = _check_shard_rule(s, infer_tp) if mode == "shard" else None
        if why:
            raise ValueError(
                f"tensor {s.name}: dimension {s.tp_dim} of shape {s.shape} cannot be cut for the "
                f"rollout engine's tp={infer_tp}: {why}"
            )


def _buckets(
    specs: Sequence[PlannedTensor], per_rank_cost: Callable[[int], int], bucket_bytes: int
) -> list[list[int]]:
    """Consecutive groups packed greedily: a bucket's largest per-rank cost stays <= bucket_bytes."""
    groups: list[list[int]] = []
    for i, s in enumerate(specs):
        if groups and specs[groups[-1][0]].key == s.key:
            groups[-1].append(i)
        else:
            groups.append([i])
    keys = [specs[g[0]].key for g in groups]
    if len(set(keys)) != len(keys):
        raise ValueError("the specs of a group must be consecutive in the tensor list")
    buckets: list[list[int]] = []
    current: list[int] = []
    cost = 0
    for g in groups:
        c = sum(per_rank_cost(i) for i in g)
        if current and cost + c > bucket_bytes:
            buckets.append(current)
            current, cost = [], 0
        current += g
        cost += c
    if current:
        buckets.append(current)
    return buckets


def _check_inputs(
    specs: Sequence[PlannedTensor],
    tp: int,
    pp: int,
    dp: int,
    infer_tp: int,
    mode: str,
    ep: int,
    ranks_per_node: int | None,
) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown reshard mode {mode!r}; known: {MODES}")
    world = tp * pp * dp
    if world % infer_tp:
        raise ValueError(f"infer_tp={infer_tp} does not divide the world size {world}")
    if ep < 1 or dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}")
    if ranks_per_node is not None and ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be positive, got {ranks_per_node}")
    check_specs(specs, tp, pp, infer_tp, mode, ep)


def _empty_plan(specs, tp, pp, dp, infer_tp, bucket_bytes, mode, ep) -> ReshardSchedule:
    return ReshardSchedule(
        tp=tp,
        pp=pp,
        dp=dp,
        infer_tp=infer_tp,
        mode=mode,
        bucket_bytes=bucket_bytes,
        specs=tuple(specs),
        buckets=[],
        ranks={r: [] for r in range(tp * pp * dp)},
        ep=ep,
    )


# (receiving rank, source rank or None when the rank holds the slice, start, stop)
Delivery = tuple[int, int | None, int, int]


def _deliveries(
    t: int,
    pieces: dict[Range, list[int]],
    world: int,
    ranges_of: Callable[[int], tuple[Range, ...]],
    ranks_per_node: int | None,
) -> list[Delivery]:
    """Every slice of spec ``t`` each rank needs and where it comes from, in one global order
    (piece, receiving rank, range): both ends of each pair of ranks see their messages in the
    same order. A slice a rank holds is copied; else a holder sends it, one on the receiver's
    node when there is one (``ranks_per_node``), spread over the candidates by receiving rank,
    shifted per tensor."""
    out: list[Delivery] = []
    for (a, b), holders in pieces.items():
        held = set(holders)
        by_node: dict[int, list[int]] = {}
        if ranks_per_node is not None:
            for h in holders:
                by_node.setdefault(h // ranks_per_node, []).append(h)
        for r in range(world):
            for lo, hi in ranges_of(r):
                s0, s1 = max(a, lo), min(b, hi)
                if s0 >= s1:
                    continue
                if r in held:
                    out.append((r, None, s0, s1))
                    continue
                near = by_node.get(r // ranks_per_node) if ranks_per_node is not None else None
                candidates = near or holders
                out.append((r, candidates[(r + t) % len(candidates)], s0, s1))
    return out


def _need_table(plan: ReshardSchedule) -> Callable[[int, int], tuple[Range, ...]]:
    """``(spec index, rank) -> ranges`` (each spec's ranges per inference TP rank, computed once)."""
    itp = plan.infer_tp if plan.mode == "shard" else 1
    table = [[need_ranges(s, plan, i) for i in range(itp)] for s in plan.specs]
    return lambda t, rank: table[t][rank % itp]


def schedule_reshard(
    specs: Sequence[PlannedTensor],
    tp: int,
    pp: int,
    dp: int,
    infer_tp: int,
    bucket_bytes: int,
    mode: str = "full",
    ep: int = 1,
    ranks_per_node: int | None = None,
) -> ReshardSchedule:
    """Plan moving every spec from the training layout to the inference layout (see module doc);
    ``ranks_per_node`` (consecutive ranks per node; None: one node) makes each slice come from
    a holder on the receiver's node where there is one."""
    _check_inputs(specs, tp, pp, dp, infer_tp, mode, ep, ranks_per_node)
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    plan = _empty_plan(specs, tp, pp, dp, infer_tp, bucket_bytes, mode, ep)
    specs = plan.specs
    world = plan.world_size
    ranges = _need_table(plan)
    itp = infer_tp if mode == "shard" else 1

    def cost(t: int) -> int:
        return max(range_length(ranges(t, i)) for i in range(itp)) * specs[t].row_bytes()

    plan.buckets = _buckets(specs, cost, bucket_bytes)
    for b, members in enumerate(plan.buckets):
        rank_buckets = {r: RankBucket(index=b) for r in range(world)}
        for t in members:
            row = specs[t].row_bytes()
            for r in range(world):
                rank_buckets[r].needs[t] = ranges(t, r)
            pieces = _pieces(specs[t], plan)
            for r, src, s0, s1 in _deliveries(t, pieces, world, partial(ranges, t), ranks_per_node):
                sl = Slice(t, s0, s1)
                nbytes = (s1 - s0) * row
                if src is None:
                    rank_buckets[r].ops.append(Op("copy", r, sl, nbytes))
                else:
                    rank_buckets[src].ops.append(Op("send", r, sl, nbytes))
                    rank_buckets[r].ops.append(Op("recv", src, sl, nbytes))
        for r in range(world):
            plan.ranks[r].append(rank_buckets[r])
    return plan


@dataclass(frozen=True)
class RankTraffic:
    """One rank's bytes in a reshard: what its rollout engine loads (``need``), what it receives,
    the least any plan must deliver to it (``minimum``: needed and not held), and how much of
    what it receives comes from other nodes."""

    need: int
    recv: int
    minimum: int
    cross_node: int


def reshard_traffic(
    specs: Sequence[PlannedTensor],
    tp: int,
    pp: int,
    dp: int,
    infer_tp: int,
    mode: str = "full",
    ep: int = 1,
    ranks_per_node: int | None = None,
) -> list[RankTraffic]:
    """Per rank, the bytes :func:`schedule_reshard` moves, without building its ops (fast enough for
    ``megarl plan`` at hundreds of GPUs). The plan delivers each byte a rank needs and does not
    hold exactly once, from a holder on its own node when there is one: so a rank receives
    exactly its minimum, and across nodes exactly the part of it no holder on its node has.
    Specs alike but for their name (same shape, split, stage, holder, rule: the same weight of
    every layer of a stage) are worked out once. The unit tests hold these figures equal to the
    ops of :func:`schedule_reshard`."""
    _check_inputs(specs, tp, pp, dp, infer_tp, mode, ep, ranks_per_node)
    plan = _empty_plan(specs, tp, pp, dp, infer_tp, 1, mode, ep)
    world = plan.world_size
    kinds: dict[tuple, list[int]] = {}
    for t, s in enumerate(plan.specs):
        key = (s.shape, s.tp_dim, s.stage, s.itemsize, s.expert_rank, s.shard_rule)
        kinds.setdefault(key, []).append(t)
    itp = infer_tp if mode == "shard" else 1
    need, unheld, cross = ([0] * world for _ in range(3))
    for members in kinds.values():
        spec = plan.specs[members[0]]
        row = len(members) * spec.row_bytes()
        pieces = list(_pieces(spec, plan).items())
        table = [need_ranges(spec, plan, i) for i in range(itp)]
        # overlap[i][k]: rows of training piece k that inference rank i needs
        overlap = [
            [sum(max(0, min(b, hi) - max(a, lo)) for lo, hi in table[i]) for (a, b), _ in pieces]
            for i in range(itp)
        ]
        held: dict[int, set[int]] = {}
        for k, (_, holders) in enumerate(pieces):
            for h in holders:
                held.setdefault(h, set()).add(k)
        nodes = [
            {h // ranks_per_node for h in holders} if ranks_per_node else set()
            for _, holders in pieces
        ]
        for r in range(world):
            i, mine = r % itp, held.get(r, set())
            need[r] += range_length(table[i]) * row
            for k, rows in enumerate(overlap[i]):
                if not rows or k in mine:
                    continue
                unheld[r] += rows * row
                if ranks_per_node is not None and r // ranks_per_node not in nodes[k]:
                    cross[r] += rows * row
    return [RankTraffic(need[r], unheld[r], unheld[r], cross[r]) for r in range(world)]
