"""Run a reshard plan over torch.distributed, bucket by bucket, and hand each bucket on in HF layout.

Per bucket a rank allocates the tensors (or inference shards) it assembles, posts all its sends
and receives of the bucket at once (``batch_isend_irecv``: gloo on CPU, NCCL on GPUs), copies the
slices it already holds, converts the result to Hugging Face names and layout with the shared
transforms of :mod:`megarl.models.hf_map`, passes it to ``sink`` and drops it before the next
bucket. Bytes sent and received and the peak of the executor's own transient allocations are
counted per rank (:class:`ReshardStats`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl import platform
from megarl.hybrid_engine.reshard_plan import RankBucket, ReshardPlan, TensorSpec
from megarl.models.dims import ModelDims
from megarl.models.hf_map import NameIndex, split_qkv, to_naming

Sink = Callable[[list[tuple[str, torch.Tensor]]], None]


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
    specs: Sequence[TensorSpec],
    expert_offset: int = 0,
) -> dict[int, torch.Tensor]:
    """This rank's training shard of every spec it holds (views of the model's parameters).

    The plan names tensors in the local spec's naming; a Transformer Engine model's parameter
    names are converted to it first. An expert's weight is named by its global expert index
    (this rank's first expert is ``expert_offset``)."""
    from megarl.models.loading import mapped_parameters

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


class ReshardExecutor:
    """Runs one rank's part of a :class:`ReshardPlan` (the same plan on every rank)."""

    def __init__(self, plan: ReshardPlan, dims: ModelDims, rank: int, group=None):
        self.plan = plan
        self.dims = dims
        self.rank = rank
        self.group = group
        self.rank_plan: list[RankBucket] = plan.for_rank(rank)
        self._hf = NameIndex(dims, 0)
        tp = plan.tp
        self._train_tp_rank = rank % tp

    # -- geometry ------------------------------------------------------------------------------
    def _dest_shape(self, spec: TensorSpec, lo: int, hi: int) -> tuple[int, ...]:
        if spec.tp_dim is None:
            return spec.shape
        shape = list(spec.shape)
        shape[spec.tp_dim] = hi - lo
        return tuple(shape)

    def _src_view(self, spec: TensorSpec, local: torch.Tensor, start: int, stop: int):
        if spec.tp_dim is None:
            return local
        piece_start = self._train_tp_rank * (spec.shape[spec.tp_dim] // self.plan.tp)
        return local.narrow(spec.tp_dim, start - piece_start, stop - start)

    # -- running -------------------------------------------------------------------------------
    @torch.no_grad()
    def run(
        self,
        local: dict[int, torch.Tensor],
        sink: Sink,
        stats: ReshardStats | None = None,
        convert: bool = True,
    ) -> ReshardStats:
        """Move every bucket; ``sink`` gets ``[(hf_name, tensor)]`` (or ``[(spec name, shard)]``
        with ``convert=False``) and must not keep references it does not own afterwards."""
        stats = stats or ReshardStats()
        t_start = time.perf_counter()
        specs = self.plan.specs
        for rb in self.rank_plan:
            dtype_of = {t: self._dtype(t, local) for t in rb.needs}
            dest: dict[int, torch.Tensor] = {}
            for t, (lo, hi) in rb.needs.items():
                dest[t] = torch.empty(
                    self._dest_shape(specs[t], lo, hi),
                    dtype=dtype_of[t],
                    device=self._device(local),
                )
                stats.alloc(_nbytes(dest[t]))
            bucket_bytes = sum(_nbytes(d) for d in dest.values())
            p2p, staged, pending = [], [], []
            pair_count: dict[tuple[int, int], int] = {}
            for op in rb.ops:
                spec = specs[op.slice.tensor]
                s = op.slice
                if op.kind in ("send", "recv"):
                    key = (op.peer, 0 if op.kind == "send" else 1)
                    tag = pair_count.get(key, 0)
                    pair_count[key] = tag + 1
                if op.kind == "send":
                    view = self._src_view(spec, local[s.tensor], s.start, s.stop)
                    if not view.is_contiguous():
                        view = view.contiguous()
                        staged.append(view)
                        stats.alloc(_nbytes(view))
                    p2p.append(dist.P2POp(dist.isend, view, op.peer, self.group, tag))
                    stats.sent_bytes += op.nbytes
                elif op.kind == "recv":
                    lo, _ = rb.needs[s.tensor]
                    target = self._dest_view(spec, dest[s.tensor], s.start - lo, s.stop - s.start)
                    if not target.is_contiguous():
                        tmp = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                        stats.alloc(_nbytes(tmp))
                        pending.append((target, tmp))
                        target = tmp
                    p2p.append(dist.P2POp(dist.irecv, target, op.peer, self.group, tag))
                    stats.recv_bytes += op.nbytes
                else:  # copy
                    lo, _ = rb.needs[s.tensor]
                    target = self._dest_view(spec, dest[s.tensor], s.start - lo, s.stop - s.start)
                    target.copy_(self._src_view(spec, local[s.tensor], s.start, s.stop))
                    stats.copied_bytes += op.nbytes
            if p2p:
                t0 = time.perf_counter()
                for work in dist.batch_isend_irecv(p2p):
                    work.wait()
                stats.comm_seconds += time.perf_counter() - t0
            for target, tmp in pending:
                target.copy_(tmp)
                stats.free(_nbytes(tmp))
            for view in staged:
                stats.free(_nbytes(view))
            del p2p, staged, pending
            members = self.plan.buckets[rb.index]
            if convert:
                out = list(self._to_hf(members, dest, stats))
            else:
                out = [(specs[t].name, dest[t]) for t in members]
            sink(out)
            del out
            dest.clear()
            release = getattr(local, "release", None)  # tensors made for this bucket on read
            if release is not None:
                release()
            stats.free(bucket_bytes)
            stats.buckets += 1
        stats.seconds += time.perf_counter() - t_start
        return stats

    def _dest_view(self, spec: TensorSpec, full: torch.Tensor, start: int, length: int):
        if spec.tp_dim is None:
            return full
        return full.narrow(spec.tp_dim, start, length)

    def _dtype(self, t: int, local: dict[int, torch.Tensor]) -> torch.dtype:
        if local:
            return next(iter(local.values())).dtype
        return {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[
            self.plan.specs[t].itemsize
        ]

    def _device(self, local: dict[int, torch.Tensor]) -> torch.device:
        if local:
            return next(iter(local.values())).device
        return platform.device()

    def _to_hf(
        self, members: list[int], dest: dict[int, torch.Tensor], stats: ReshardStats
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if self.plan.mode != "full":
            raise ValueError("HF conversion needs whole tensors (plan mode 'full')")
        return to_hf_tensors(self.plan.specs, members, dest, self.dims, stats, self._hf)


def to_hf_tensors(
    specs: Sequence[TensorSpec],
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


def hf_output_shapes(plan: ReshardPlan, dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """The HF name and shape of every tensor a full-mode plan hands on (for validation up front)."""
    return hf_shapes_of(plan.specs, dims)


def hf_shapes_of(specs: Sequence[TensorSpec], dims: ModelDims) -> dict[str, tuple[int, ...]]:
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
