"""Enumerate layouts for a model on a cluster, keep those that fit, rank them, explain the rest.

Candidates: TP among the divisors of the node size (TP never crosses a node), PP among the
divisors of GPUs / TP (so DP = GPUs / (TP x PP) is whole), the rollout's ``infer_tp`` among the
divisors of the node size, and for each layout recompute on/off and optimizer offload on/off.
A layout the model cannot take (heads, KV heads, FFN size or vocabulary not divisible by TP,
layers not by PP and no uneven split works) is rejected with
:class:`~megarl.parallel.ParallelLayout`'s own message. When PP does not divide the layers, the
uneven split of :func:`uneven_split` (``parallel.pp_layers``) is used. A
layout is feasible when some knob setting's peak fits the GPU memory (and, in vLLM's fraction
mode, its KV cache holds one whole sequence). For each training layout (TP, PP) the fastest
feasible setting (infer_tp, recompute, offload) is reported; a training layout with no feasible
setting is explained by its smallest-memory setting.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field, replace

from megarl.errors import LayoutError, MegarlError
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.plan.cost import StepTime, step_time
from megarl.plan.hardware import Cluster, divisors
from megarl.plan.memory import GPU_BF16, MemoryEstimate, Numerics, Options, estimate_memory
from megarl.plan.params import stage_params
from megarl.plan.units import fmt_gib
from megarl.plan.workload import Workload


@dataclass
class Evaluated:
    layout: ParallelLayout
    options: Options
    memory: MemoryEstimate
    time: StepTime
    fits: bool
    why_not: str = ""  # a memory reason when it does not fit


@dataclass
class Rejected:
    layout: ParallelLayout
    reason: str  # the group key
    detail: str = ""  # numbers for this layout (memory reasons)
    evaluated: Evaluated | None = None


@dataclass
class PlanResult:
    model: str
    dims: ModelDims
    cluster: Cluster
    workload: Workload
    numerics: Numerics
    feasible: list[Evaluated]  # best setting per (TP, PP), fastest first
    variants: dict[tuple[int, int, int], list[Evaluated]]  # every feasible setting per (TP, PP, EP)
    rejected: list[Rejected]  # training layouts with no feasible setting, and why
    infer_tp_rejected: dict[str, list[int]] = field(default_factory=dict)  # reason -> infer_tp
    suggestions: list[str] = field(default_factory=list)

    @property
    def nothing_fits(self) -> bool:
        return not self.feasible

    def rejected_by_reason(self) -> dict[str, list[Rejected]]:
        groups: dict[str, list[Rejected]] = defaultdict(list)
        for r in self.rejected:
            groups[r.reason].append(r)
        return dict(groups)


@dataclass(frozen=True)
class Filters:
    """Restrict the search (None: try every value)."""

    tp: int | None = None
    pp: int | None = None
    infer_tp: int | None = None
    ep: int | None = None  # MoE models: expert parallel size (None: every divisor that fits)
    recompute: str | None = None  # none | selective | full
    optimizer_offload: bool | None = None
    param_offload: bool = False
    packing: bool | None = None  # actor.packing
    sequence_parallel: bool | None = None  # parallel.sequence_parallel (None: on when tp > 1)


def _ep_choices(dims: ModelDims, dp: int, only: int | None) -> list[int]:
    """Expert-parallel sizes to try: 1 for a dense model, else the divisors of the experts that
    divide DP (or the one asked for; the layout check explains a bad one)."""
    if only is not None:
        return [only]
    if not dims.is_moe:
        return [1]
    return [e for e in divisors(dims.num_experts) if dp % e == 0]


def uneven_split(layers: int, pp: int) -> tuple[int, ...] | None:
    """None when ``pp`` divides the layers (or exceeds them); else an uneven split megatron takes
    (equal middle stages). Preferred: lighter first and last stages (they also hold the embedding
    and the output layer), middle stages of ceil(layers / pp); when that leaves the ends empty,
    middle stages of floor(layers / pp) and the rest on the ends."""
    if layers % pp == 0 or pp > layers:
        return None
    if pp == 2:
        return (layers // 2, layers - layers // 2)
    for middle in (-(-layers // pp), layers // pp):
        rest = layers - middle * (pp - 2)
        if middle >= 1 and rest >= 2:
            return (rest // 2, *([middle] * (pp - 2)), rest - rest // 2)
    return None


def _memory_reason(e: Evaluated, cluster: Cluster, workload: Workload) -> tuple[str, str]:
    worst = e.memory.worst
    item, _ = worst.largest_item
    kv = worst.kv_capacity_tokens
    if kv is not None and kv < workload.seq_len and worst.peak <= cluster.gpu_memory:
        return (
            f"vLLM KV cache: gpu_memory_utilization={workload.gpu_memory_utilization} leaves room "
            f"for fewer tokens than one {workload.seq_len}-token sequence",
            f"{kv} tokens of KV cache per engine",
        )
    top = sorted(worst.items.items(), key=lambda kv_: -kv_[1])[:3]
    parts = ", ".join(f"{name} {fmt_gib(v)}" for name, v in top if v)
    reason = (
        f"memory: more than {fmt_gib(cluster.gpu_memory)} GiB per GPU even with the smallest "
        f"setting; largest item: {item}"
    )
    detail = (
        f"{fmt_gib(worst.peak)} GiB > {fmt_gib(cluster.gpu_memory)} GiB at stage {worst.stage} "
        f"in {worst.phase} ({parts})"
    )
    return reason, detail


def _fits(memory: MemoryEstimate, cluster: Cluster, workload: Workload) -> bool:
    if memory.peak > cluster.gpu_memory:
        return False
    kv = memory.worst.kv_capacity_tokens
    return kv is None or kv >= workload.seq_len


def _knobs(filters: Filters, flash_attention: bool) -> list[Options]:
    # With flash attention selective recompute saves nothing (no stored scores): not tried.
    kinds = ["none", "full"] if flash_attention else ["none", "selective", "full"]
    rcs = [filters.recompute] if filters.recompute is not None else kinds
    offs = [filters.optimizer_offload] if filters.optimizer_offload is not None else [False, True]
    packs = [filters.packing] if filters.packing is not None else [True, False]
    return [
        Options(
            recompute=rc,
            optimizer_offload=off,
            param_offload=filters.param_offload,
            packing=pack,
            sequence_parallel=filters.sequence_parallel,
        )
        for rc, off, pack in itertools.product(rcs, offs, packs)
    ]


def search(
    model: str,
    dims: ModelDims,
    cluster: Cluster,
    workload: Workload,
    numerics: Numerics = GPU_BF16,
    filters: Filters = Filters(),
    suggest: bool = True,
) -> PlanResult:
    """Every candidate layout evaluated; ``suggest``: when nothing fits, work out what would."""
    n = cluster.gpus
    infer_choices: list[int | None] = [t for t in divisors(cluster.node_size) if n % t == 0]
    if not workload.rollout:
        infer_choices = [None]
    elif filters.infer_tp is not None:
        infer_choices = [filters.infer_tp]
    variants: dict[tuple[int, int, int], list[Evaluated]] = defaultdict(list)
    rejected: list[Rejected] = []
    infer_notes: dict[str, set[int]] = defaultdict(set)
    tps = [filters.tp] if filters.tp is not None else cluster.tp_choices()
    for tp in tps:
        pps = [filters.pp] if filters.pp is not None else divisors(n // tp)
        for pp in pps:
            if n % (tp * pp):
                reason = f"tp*pp = {tp * pp} does not divide {n} GPUs"
                rejected.append(Rejected(ParallelLayout(tp=tp, pp=pp), reason))
                continue
            for ep in _ep_choices(dims, n // (tp * pp), filters.ep):
                split = uneven_split(dims.num_layers, pp)
                try:
                    base = ParallelLayout(tp=tp, pp=pp, dp=n // (tp * pp), pp_layers=split, ep=ep)
                    base.check_model(dims.shape)
                except LayoutError as e:
                    shown = ParallelLayout(tp=tp, pp=pp, dp=n // (tp * pp), pp_layers=split)
                    rejected.append(Rejected(shown, str(e)))
                    continue
                evaluated = []
                for itp in infer_choices:
                    layout = replace(base, infer_tp=itp)
                    try:
                        layout.check_model(dims.shape)
                    except LayoutError as e:
                        infer_notes[str(e)].add(itp or tp)
                        continue
                    for opts in _knobs(filters, numerics.activations.flash_attention):
                        evaluated.append(_evaluate(dims, layout, workload, numerics, opts, cluster))
                fitting = [e for e in evaluated if e.fits]
                if fitting:
                    variants[(tp, pp, ep)].extend(fitting)
                elif evaluated:
                    smallest = min(evaluated, key=lambda e: e.memory.peak)
                    reason, detail = _memory_reason(smallest, cluster, workload)
                    rejected.append(Rejected(smallest.layout, reason, detail, smallest))
    for key in variants:
        variants[key].sort(key=lambda e: (e.time.total, e.memory.peak))
    feasible = sorted(
        (v[0] for v in variants.values()), key=lambda e: (e.time.total, e.memory.peak)
    )
    result = PlanResult(
        model,
        dims,
        cluster,
        workload,
        numerics,
        feasible,
        dict(variants),
        rejected,
        infer_tp_rejected={k: sorted(v) for k, v in infer_notes.items()},
    )
    if not feasible and suggest:
        result.suggestions = _suggestions(result, filters)
    return result


def _evaluate(
    dims: ModelDims,
    layout: ParallelLayout,
    workload: Workload,
    numerics: Numerics,
    opts: Options,
    cluster: Cluster,
) -> Evaluated:
    memory = estimate_memory(
        dims, layout, workload, numerics, opts, cluster.gpu_memory, cluster.reserve
    )
    time = step_time(
        dims, layout, workload, opts, cluster, numerics, kv_tokens=memory.worst.kv_capacity_tokens
    )
    return Evaluated(layout, opts, memory, time, _fits(memory, cluster, workload))


def _suggestions(result: PlanResult, filters: Filters) -> list[str]:
    """What to change when nothing fits, with numbers."""
    cluster, workload = result.cluster, result.workload
    tried = [r.evaluated for r in result.rejected if r.evaluated is not None]
    out = []
    if not tried:
        out.append(
            "no layout passes the model's divisibility rules on this many GPUs: choose a GPU "
            "count whose divisors include a valid TP and PP (see the reasons above)"
        )
        return out
    best = min(tried, key=lambda e: e.memory.peak)
    knobs = [
        k
        for k, on in (
            (f"{best.options.recompute} recompute", best.options.recompute != "none"),
            ("optimizer offload", best.options.optimizer_offload),
        )
        if on
    ]
    out.append(
        f"the smallest need is {fmt_gib(best.memory.peak)} GiB per GPU ({best.layout}, infer_tp "
        f"{best.layout.rollout_tp}{', ' + ', '.join(knobs) if knobs else ''}): use GPUs with at "
        f"least that much memory (--gpu-memory)"
    )
    for factor in (2, 4, 8, 16):
        bigger = replace(cluster, gpus=cluster.gpus * factor)
        try:
            r = search(result.model, result.dims, bigger, workload, result.numerics, filters, False)
        except MegarlError:  # an impossible bigger cluster is not a suggestion
            continue
        if r.feasible:
            top = r.feasible[0]
            out.append(
                f"or use {bigger.gpus} GPUs of this size (--gpus {bigger.gpus}); the fastest "
                f"layout there: {top.layout}, infer_tp {top.layout.rollout_tp}, peak "
                f"{fmt_gib(top.memory.peak)} GiB"
            )
            break
    widest = max(divisors(cluster.node_size))
    vllm_weights = stage_params(result.dims, widest, 1, 0, result.dims.num_layers).total * 2
    reserve = best.memory.reserve.total
    if workload.rollout and vllm_weights + reserve > cluster.gpu_memory:
        out.append(
            f"the rollout alone cannot fit: vLLM's bf16 weights at the widest in-node infer_tp "
            f"({widest}) are {fmt_gib(vllm_weights)} GiB per GPU; it needs GPUs with more memory "
            f"or a rollout engine spanning nodes (not supported by megarl)"
        )
    item, _ = best.memory.worst.largest_item
    if item == "activations":
        out.append("or shorten --seq-len or lower --batch: activations are the largest item")
    if item == "rollout":
        out.append(
            "or lower --rollout-seqs / --gpu-memory-utilization, or add --param-offload: the "
            "rollout phase is the peak"
        )
    if not filters.param_offload and best.memory.worst.phase == "rollout":
        out.append("or try --param-offload (weights leave the GPU while vLLM generates)")
    return out
