"""Run a reshard schedule over torch.distributed, bucket by bucket, and hand each bucket on in HF layout.

Per bucket a rank allocates the tensors (or inference shards) it assembles, posts all its sends
and receives of the bucket at once (``batch_isend_irecv``: gloo on CPU, NCCL on GPUs) and copies
the slices it already holds. Buckets are double-buffered: once bucket ``k`` has arrived, bucket
``k + 1``'s sends and receives are posted before bucket ``k`` is converted to Hugging Face names
and layout (the shared transforms of :mod:`megarl.models.hf_map`) and passed to ``sink`` (the
rollout engine's load), so the transfer of one bucket overlaps the load of the previous one and
at most two buckets are in memory. In ``full`` mode the sink gets whole HF tensors
``[(hf_name, tensor)]``; in ``shard`` mode the slices this rank's rollout TP rank loads
``[(ShardSlice, tensor)]``. Bytes sent and received and the peak of the executor's own transient
allocations are counted per rank (:class:`ReshardStats`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl import platform
from megarl.models.dims import ModelDims
from megarl.models.hf_map import NameIndex, split_qkv, split_qkv_shard, to_naming
from megarl.models.loading import mapped_parameters
from megarl.weights.reshard_schedule import (
    PlannedTensor,
    RankBucket,
    ReshardSchedule,
    dest_offset,
    range_length,
)
from megarl.weights.weight_shards import ShardSlice, WeightShard

# A bucket as the executor hands it on: [(hf_name, tensor)] in full mode, [(ShardSlice, slice)] in
# shard mode, [(spec name, tensor)] unconverted.
Sink = Callable[[list], None]


@dataclass
class ReshardStats:
    sent_bytes: int = 0
    recv_bytes: int = 0
    copied_bytes: int = 0
    peak_transient_bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    comm_seconds: float = 0.0
    _live: int = field(default=0, repr=False)

    def alloc(self, nbytes: int) -> None:
        self._live += nbytes
        self.peak_transient_bytes = max(self.peak_transient_bytes, self._live)

    def free(self, nbytes: int) -> None:
        self._live -= nbytes

    def as_metrics(self, prefix: str = "reshard/") -> dict[str, float]:
        return {
            prefix + "sent_bytes": float(self.sent_bytes),
            prefix + "recv_bytes": float(self.recv_bytes),
            prefix + "peak_transient_bytes": float(self.peak_transient_bytes),
            prefix + "buckets": float(self.buckets),
            prefix + "seconds": self.seconds,
        }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def local_spec_tensors(
    model,
    dims: ModelDims,
    layer_offset: int,
    specs: Sequence[PlannedTensor],
    expert_offset: int = 0,
) -> dict[int, torch.Tensor]:
    """This rank's training shard of every spec it holds (views of the model's parameters).

    The plan names tensors in the local spec's naming; a Transformer Engine model's parameter
    names are converted to it first. An expert's weight is named by its global expert index
    (this rank's first expert is ``expert_offset``)."""

    index = {s.name: i for i, s in enumerate(specs)}
    local = NameIndex(dims, layer_offset)
    out: dict[int, torch.Tensor] = {}
    for spec_name, param in mapped_parameters(model):
        name = to_naming(spec_name, "local")
        tm, _ = local.lookup(name)
        global_name = _global_name(name, layer_offset) if tm.per_layer else name
        if tm.per_expert:
            global_name = _global_expert_name(global_name, expert_offset)
        data = param.detach()
        if tm.kind == "gate_up":
            for part, half in enumerate(data.chunk(2, dim=0)):
                i = index.get(f"{global_name}#{part}")
                if i is not None:
                    out[i] = half
        elif global_name in index:
            out[index[global_name]] = data
    return out


def _global_name(name: str, offset: int) -> str:
    head, _, rest = name.partition("decoder.layers.")
    layer, _, tail = rest.partition(".")
    return f"{head}decoder.layers.{int(layer) + offset}.{tail}"


_LOCAL_EXPERT = re.compile(r"(\.local_experts\.)(\d+)\.")


def _global_expert_name(name: str, offset: int) -> str:
    return _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}.", name, count=1)


@dataclass
class _Bucket:
    """A bucket whose sends and receives are posted: its tensors, and what must live until the
    transfers complete."""

    rb: RankBucket
    dest: dict[int, torch.Tensor]
    works: list
    keep: list[torch.Tensor]  # send views (and contiguous copies of them)
    staged: list[tuple[torch.Tensor, torch.Tensor]]  # (target view, receive buffer)
    nbytes: int  # dest bytes
    staged_bytes: int


class ReshardExecutor:
    """Runs one rank's part of a :class:`ReshardSchedule` (the same plan on every rank)."""

    def __init__(self, plan: ReshardSchedule, dims: ModelDims, rank: int, group=None):
        self.plan = plan
        self.dims = dims
        self.rank = rank
        self.group = group
        self.rank_plan: list[RankBucket] = plan.for_rank(rank)
        self._hf = NameIndex(dims, 0)
        self._train_tp_rank = rank % plan.tp
        self._infer_rank = rank % plan.infer_tp
        self._tags: dict[tuple[int, str], int] = {}

    # -- geometry ------------------------------------------------------------------------------
    def _dest_shape(
        self, spec: PlannedTensor, ranges: tuple[tuple[int, int], ...]
    ) -> tuple[int, ...]:
        if spec.tp_dim is None:
            return spec.shape
        shape = list(spec.shape)
        shape[spec.tp_dim] = range_length(ranges)
        return tuple(shape)

    def _src_view(self, spec: PlannedTensor, local: torch.Tensor, start: int, stop: int):
        if spec.tp_dim is None:
            return local
        piece_start = self._train_tp_rank * (spec.shape[spec.tp_dim] // self.plan.tp)
        return local.narrow(spec.tp_dim, start - piece_start, stop - start)

    def _dest_view(
        self, spec: PlannedTensor, dest: torch.Tensor, rb: RankBucket, s
    ) -> torch.Tensor:
        if spec.tp_dim is None:
            return dest
        return dest.narrow(spec.tp_dim, dest_offset(rb.needs[s.tensor], s.start), s.stop - s.start)

    # -- running -------------------------------------------------------------------------------
    @torch.no_grad()
    def run(
        self,
        local: dict[int, torch.Tensor],
        sink: Sink,
        stats: ReshardStats | None = None,
        convert: bool = True,
    ) -> ReshardStats:
        """Move every bucket; ``sink`` gets the bucket in HF layout (``convert=False``: as
        ``[(spec name, tensor)]`` in megatron's layout) and must not keep references it does not
        own afterwards."""
        stats = stats or ReshardStats()
        t_start = time.perf_counter()
        self._tags = {}  # every rank starts each run's message count afresh
        buckets = self.rank_plan
        posted = self._post(buckets[0], local, stats) if buckets else None
        for k in range(len(buckets)):
            current = posted
            assert current is not None
            self._complete(current, stats)
            # The next bucket travels while this one is converted and loaded.
            posted = self._post(buckets[k + 1], local, stats) if k + 1 < len(buckets) else None
            members = self.plan.buckets[current.rb.index]
            if convert:
                out = list(self._to_hf(current.rb, members, current.dest, stats))
            else:
                out = [(self.plan.specs[t].name, current.dest[t]) for t in members]
            sink(out)
            del out
            current.dest.clear()
            stats.free(current.nbytes)
            stats.buckets += 1
        stats.seconds += time.perf_counter() - t_start
        return stats

    def _post(self, rb: RankBucket, local: dict[int, torch.Tensor], stats: ReshardStats) -> _Bucket:
        """Allocate the bucket, copy what this rank holds, post its sends and receives."""
        specs = self.plan.specs
        dtype, device = self._dtype(local), self._device(local)
        dest: dict[int, torch.Tensor] = {}
        for t, ranges in rb.needs.items():
            dest[t] = torch.empty(self._dest_shape(specs[t], ranges), dtype=dtype, device=device)
        nbytes = sum(_nbytes(d) for d in dest.values())
        stats.alloc(nbytes)
        p2p, keep, staged = [], [], []
        staged_bytes = 0
        for op in rb.ops:
            spec, s = specs[op.slice.tensor], op.slice
            if op.kind == "copy":
                target = self._dest_view(spec, dest[s.tensor], rb, s)
                target.copy_(self._src_view(spec, local[s.tensor], s.start, s.stop))
                stats.copied_bytes += op.nbytes
                continue
            # Tags count each pair's messages over the run, not the bucket: two buckets in flight
            # between the same ranks never match each other's messages.
            key = (op.peer, op.kind)
            tag = self._tags.get(key, 0)
            self._tags[key] = tag + 1
            if op.kind == "send":
                view = self._src_view(spec, local[s.tensor], s.start, s.stop)
                if not view.is_contiguous():
                    view = view.contiguous()
                    staged_bytes += _nbytes(view)
                keep.append(view)
                p2p.append(dist.P2POp(dist.isend, view, op.peer, self.group, tag))
                stats.sent_bytes += op.nbytes
            else:
                target = self._dest_view(spec, dest[s.tensor], rb, s)
                if not target.is_contiguous():
                    buf = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                    staged_bytes += _nbytes(buf)
                    staged.append((target, buf))
                    target = buf
                p2p.append(dist.P2POp(dist.irecv, target, op.peer, self.group, tag))
                stats.recv_bytes += op.nbytes
        stats.alloc(staged_bytes)
        works = dist.batch_isend_irecv(p2p) if p2p else []
        release = getattr(local, "release", None)  # tensors made for this bucket on read
        if release is not None:
            release()
        return _Bucket(rb, dest, works, keep, staged, nbytes, staged_bytes)

    def _complete(self, bucket: _Bucket, stats: ReshardStats) -> None:
        """Wait for the bucket's transfers; move staged receives into place."""
        t0 = time.perf_counter()
        for work in bucket.works:
            work.wait()
        stats.comm_seconds += time.perf_counter() - t0
        for target, buf in bucket.staged:
            target.copy_(buf)
        bucket.works, bucket.keep, bucket.staged = [], [], []
        stats.free(bucket.staged_bytes)

    def _dtype(self, local: dict[int, torch.Tensor]) -> torch.dtype:
        if local:
            return next(iter(local.values())).dtype
        return {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[
            self.plan.specs[0].itemsize
        ]

    def _device(self, local: dict[int, torch.Tensor]) -> torch.device:
        if local:
            return next(iter(local.values())).device
        return platform.device()

    def _to_hf(
        self,
        rb: RankBucket,
        members: list[int],
        dest: dict[int, torch.Tensor],
        stats: ReshardStats,
    ) -> Iterator:
        """One bucket's megatron-layout tensors -> HF ``(name, tensor)`` (full mode) or
        ``(ShardSlice, slice)`` (shard mode), one group at a time."""
        if self.plan.mode == "shard":
            for t in members:
                yield from self._hf_shards(t, rb.needs[t], dest[t])
            return
        yield from to_hf_tensors(self.plan.specs, members, dest, self.dims, stats, self._hf)

    def _hf_shards(
        self, t: int, ranges: tuple[tuple[int, int], ...], shard: torch.Tensor
    ) -> list[WeightShard]:
        """One spec's inference shard as the HF slices it is made of."""
        spec = self.plan.specs[t]
        name, _, part = spec.name.partition("#")
        tm, hf_names = self._hf.lookup(name)
        if spec.tp_dim is None:
            return [(ShardSlice(hf_names[0], tuple(shard.shape), None), shard)]
        if tm.kind == "qkv":
            pieces = split_qkv_shard(shard, self.dims, self.plan.infer_tp, self._infer_rank)
            return [
                (ShardSlice(n, tuple(p.shape), spec.tp_dim, start), p)
                for n, (p, start) in zip(hf_names, pieces, strict=True)
            ]
        if len(ranges) != 1:
            raise ValueError(f"{spec.name}: a {tm.kind} tensor is cut as one range, got {ranges}")
        hf_name = hf_names[int(part)] if tm.kind == "gate_up" else hf_names[0]
        return [(ShardSlice(hf_name, tuple(shard.shape), spec.tp_dim, ranges[0][0]), shard)]

    def shard_specs(self) -> list[ShardSlice]:
        """Every HF slice a shard-mode run hands this rank's rollout engine (computed on meta
        tensors, before anything moves)."""
        out = []
        specs = self.plan.specs
        for rb in self.rank_plan:
            for t, ranges in rb.needs.items():
                meta = torch.empty(self._dest_shape(specs[t], ranges), device="meta")
                out += [s for s, _ in self._hf_shards(t, ranges, meta)]
        return out


def to_hf_tensors(
    specs: Sequence[PlannedTensor],
    members: Sequence[int],
    dest: dict[int, torch.Tensor],
    dims: ModelDims,
    stats: ReshardStats,
    index: NameIndex | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole megatron-layout tensors of one bucket (``dest``: spec index -> tensor) -> HF
    (name, tensor), one group at a time; a fused QKV leaves ``dest`` once split."""
    index = index or NameIndex(dims, 0)
    for t in members:
        spec = specs[t]
        name, _, part = spec.name.partition("#")
        tm, hf_names = index.lookup(name)
        if tm.kind == "gate_up":
            yield hf_names[int(part)], dest[t]
        elif tm.kind == "qkv":
            # The split copies; the fused buffer is dropped right after (peak: + one tensor).
            fused = dest.pop(t)
            stats.alloc(_nbytes(fused))
            q, k, v = split_qkv(fused, dims)
            stats.free(_nbytes(fused))
            del fused
            yield from zip(hf_names, (q, k, v), strict=True)
        else:
            yield hf_names[0], dest[t]


def hf_output_shapes(plan: ReshardSchedule, dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """The HF name and shape of every tensor a full-mode plan hands on (for validation up front)."""
    return hf_shapes_of(plan.specs, dims)


def hf_shapes_of(specs: Sequence[PlannedTensor], dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """The HF name and shape of every tensor that whole ``specs`` convert to."""
    index = NameIndex(dims, 0)
    out: dict[str, tuple[int, ...]] = {}
    hd = dims.head_dim
    for spec in specs:
        name, _, part = spec.name.partition("#")
        tm, hf_names = index.lookup(name)
        if tm.kind == "gate_up":
            out[hf_names[int(part)]] = spec.shape
        elif tm.kind == "qkv":
            rest = spec.shape[1:]
            sizes = (dims.num_attention_heads * hd, dims.num_kv_heads * hd, dims.num_kv_heads * hd)
            for n, rows in zip(hf_names, sizes, strict=True):
                out[n] = (rows, *rest)
        else:
            out[hf_names[0]] = spec.shape
    return out
