"""The reshard planner: which slice of which actor tensor moves from which rank to which, in buckets.

Pure and deterministic: it imports nothing of vLLM, megatron or torch. Every rank computes the same
:class:`ReshardPlan` from the same inputs and keeps its own ops (:meth:`ReshardPlan.for_rank`).

Inputs
  - the training layout (TP x PP x DP, megatron's rank order) and the inference layout
    (``layout.rollout_tp``: vLLM TP over consecutive ranks, PP 1);
  - the model's tensor list (:class:`TensorSpec`: name, full shape, the dimension split over TP
    (None: replicated), the pipeline stage that owns it, bytes per element). Megatron's fused
    gate/up weight appears as two specs of one ``group`` (gate rows, up rows) so every spec is
    split as one contiguous range per TP rank, in both layouts;
  - ``mode``: ``"full"`` (every rank needs every tensor whole: CPU vLLM cuts its own TP shard
    from full HF tensors) or ``"shard"`` (each rank needs only its inference TP shard:
    HybridFlow's zero-redundancy transition, for engines that take pre-sharded tensors);
  - ``bucket_bytes``: the most bytes of destination tensors a rank assembles per bucket (a group
    larger than that travels alone);
  - ``ep`` (mixture of experts): an expert's weights live only on the data-parallel replicas of
    its expert-parallel rank (``TensorSpec.expert_rank``; megatron's layout puts DP replica ``d``
    on EP rank ``d % ep``), split over TP like the dense tensors (expert TP = TP).

Output: buckets of ops. A ``recv`` on rank B from A always has the matching ``send`` on A to B in
the same bucket, in the same relative order; ``copy`` takes a slice this rank already holds.
Each byte a rank needs arrives exactly once (by ``copy`` when it holds it, else by one ``recv``)
and nothing it does not need is sent to it, so received bytes equal :meth:`ReshardPlan.min_recv_bytes`.
Sources are spread over the holders of a slice (DP replicas, TP ranks of replicated tensors).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

MODES = ("full", "shard")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the training model as the planner sees it."""

    name: str  # unique key, e.g. the megatron name with the global layer index (+ "#0"/"#1" part)
    shape: tuple[int, ...]
    tp_dim: int | None  # dimension split over training TP (and inference TP); None: replicated
    stage: int  # pipeline stage that holds it
    itemsize: int = 4
    group: str = ""  # specs of one group travel in the same bucket ("" = the name)
    expert_rank: int | None = None  # MoE expert weight: the EP rank holding it (None: every DP)

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
    # spec index -> (start, stop) along tp_dim that this rank assembles in this bucket
    needs: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def recv_bytes(self) -> int:
        return sum(op.nbytes for op in self.ops if op.kind == "recv")

    @property
    def send_bytes(self) -> int:
        return sum(op.nbytes for op in self.ops if op.kind == "send")

    def dest_bytes(self, specs: Sequence[TensorSpec]) -> int:
        return sum((b - a) * specs[t].row_bytes() for t, (a, b) in self.needs.items())


@dataclass
class ReshardPlan:
    tp: int
    pp: int
    dp: int
    infer_tp: int
    mode: str
    bucket_bytes: int
    specs: tuple[TensorSpec, ...]
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

    def min_recv_bytes(self, rank: int) -> int:
        """Bytes this rank needs and does not hold: the least any plan must deliver to it."""
        total = 0
        for spec in self.specs:
            lo, hi = need_range(spec, self, rank)
            for (a, b), holders in _pieces(spec, self).items():
                if rank not in holders:
                    total += max(0, min(b, hi) - max(a, lo)) * spec.row_bytes()
        return total

    def peak_dest_bytes(self, rank: int) -> int:
        return max((b.dest_bytes(self.specs) for b in self.ranks[rank]), default=0)


def _extent(spec: TensorSpec) -> int:
    return 1 if spec.tp_dim is None else spec.shape[spec.tp_dim]


def _rank_of(tp: int, dp: int, t: int, d: int, p: int) -> int:
    return t + tp * (d + dp * p)


def _pieces(spec: TensorSpec, plan: ReshardPlan) -> dict[tuple[int, int], list[int]]:
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


def need_range(spec: TensorSpec, plan: ReshardPlan, rank: int) -> tuple[int, int]:
    """The range along ``tp_dim`` a rank needs of a spec (everything in ``full`` mode)."""
    n = _extent(spec)
    if plan.mode == "full" or spec.tp_dim is None:
        return 0, n
    step = n // plan.infer_tp
    i = rank % plan.infer_tp
    return i * step, (i + 1) * step


def check_specs(
    specs: Sequence[TensorSpec], tp: int, pp: int, infer_tp: int, mode: str, ep: int = 1
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
        n = s.shape[s.tp_dim]
        ways = tp if mode == "full" else tp * infer_tp // math.gcd(tp, infer_tp)
        if n % ways:
            raise ValueError(
                f"tensor {s.name}: dimension {s.tp_dim} of shape {s.shape} does not split into "
                f"{ways} equal parts (training tp={tp}, inference tp={infer_tp})"
            )


def _buckets(specs: Sequence[TensorSpec], per_rank_cost, bucket_bytes: int) -> list[list[int]]:
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


def plan_reshard(
    specs: Sequence[TensorSpec],
    tp: int,
    pp: int,
    dp: int,
    infer_tp: int,
    bucket_bytes: int,
    mode: str = "full",
    ep: int = 1,
) -> ReshardPlan:
    """Plan moving every spec from the training layout to the inference layout (see module doc)."""
    if mode not in MODES:
        raise ValueError(f"unknown reshard mode {mode!r}; known: {MODES}")
    world = tp * pp * dp
    if world % infer_tp:
        raise ValueError(f"infer_tp={infer_tp} does not divide the world size {world}")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if ep < 1 or dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}")
    specs = tuple(specs)
    check_specs(specs, tp, pp, infer_tp, mode, ep)
    plan = ReshardPlan(
        tp=tp,
        pp=pp,
        dp=dp,
        infer_tp=infer_tp,
        mode=mode,
        bucket_bytes=bucket_bytes,
        specs=specs,
        buckets=[],
        ranks={r: [] for r in range(world)},
        ep=ep,
    )

    def cost(i: int) -> int:
        s = specs[i]
        if mode == "full" or s.tp_dim is None:
            return s.nbytes
        return s.nbytes // infer_tp

    plan.buckets = _buckets(specs, cost, bucket_bytes)
    for b, members in enumerate(plan.buckets):
        rank_buckets = {r: RankBucket(index=b) for r in range(world)}
        for t in members:
            spec = specs[t]
            pieces = _pieces(spec, plan)
            row = spec.row_bytes()
            for r in range(world):
                rank_buckets[r].needs[t] = need_range(spec, plan, r)
            # Ops in one global order (tensor, piece, receiving rank): both ends of each pair of
            # ranks see their messages in the same order.
            for (a, b_), holders in pieces.items():
                for r in range(world):
                    lo, hi = need_range(spec, plan, r)
                    s0, s1 = max(a, lo), min(b_, hi)
                    if s0 >= s1:
                        continue
                    sl = Slice(t, s0, s1)
                    nbytes = (s1 - s0) * row
                    if r in holders:
                        rank_buckets[r].ops.append(Op("copy", r, sl, nbytes))
                        continue
                    # Spread senders over holders: by receiving rank, shifted per tensor.
                    src = holders[(r + t) % len(holders)]
                    rank_buckets[src].ops.append(Op("send", r, sl, nbytes))
                    rank_buckets[r].ops.append(Op("recv", src, sl, nbytes))
        for r in range(world):
            plan.ranks[r].append(rank_buckets[r])
    return plan
