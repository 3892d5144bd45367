"""The memory preflight: this config's peak memory per GPU in each phase of a step, on the layout
it will run at, before anything starts.

It reads only the model's ``config.json`` (and the reward model's) through the run's own input
checks, builds no model and starts no process, so it runs on a laptop before a job is queued
(``megarl train CONFIG --dry-run``) and on a CUDA node before launch. What it computes is the
planner's memory model (:func:`megarl.plan.memory.estimate_memory`, :mod:`megarl.plan.host`) for
exactly the config's sizes, upper bounds where the data decide: every sequence as long as the
settings allow (``data.max_prompt_length + rollout.sampling.max_response_length``), a token-budgeted
micro-batch full to its budget. One assumption: a budgeted micro-batch's sequences are of about
one length (the trainer sorts them by length before it cuts micro-batches), so its output layer
projects at most as many positions as it holds tokens.

Phases (per GPU, the worst pipeline stage): ``build`` (megatron's DDP wrap copies the weights),
``startup`` (vLLM's ``gpu_memory_utilization`` budget taken beside what is resident: vLLM refuses
to start without that much free), ``rollout``, ``scoring`` (after vLLM sleeps: old / reference
logprobs and values in the update's micro-batches), ``update`` (forward-backward, grad sync,
optimizer step); and on the host, per node: ``rollout``, ``training`` and ``save``. When a phase
does not fit, the item it adds is named and settings that make every phase fit are searched and
listed (each one checked by running the preflight again with it).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field, replace

from megarl.config import (
    ActorConfig,
    AlgorithmConfig,
    JudgeConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    model_dtype,
    validate,
)
from megarl.config.derived import routing_recorded
from megarl.errors import ConfigError, MegarlError
from megarl.gpu_defaults import Target, kernel_options, transformer_impl
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.plan.activations import CPU_LOCAL_FP32, GPU_TE_BF16
from megarl.plan.host import HostMemory, estimate_host_memory
from megarl.plan.memory import (
    PHASE_ITEMS,
    MemoryEstimate,
    Numerics,
    Options,
    estimate_memory,
    kv_bytes_per_token,
)
from megarl.plan.units import GIB, fmt_gib
from megarl.plan.workload import Workload

DEFAULT_GPU_MEMORY = 80 * GIB
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_HOST_MEMORY = 1 << 40  # 1 TiB per node: what an 8-GPU node of the 80 GB class has
GPU_PHASES = ("build", "startup", "rollout", "judging", "scoring", "update")
UPDATE_PHASES = ("forward-backward", "grad-sync", "optimizer-step")


@dataclass(frozen=True)
class Hardware:
    """The machines a run is checked for, and where each number came from."""

    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    nnodes: int = 1
    gpu_memory: int = DEFAULT_GPU_MEMORY
    host_memory: int = DEFAULT_HOST_MEMORY  # per node
    # per GPU outside the plan's items; None: computed from the layout (megarl.plan.reserve)
    reserve: int | None = None
    sources: tuple[tuple[str, str], ...] = ()  # (what, "given" | "this machine" | "assumed")

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be a positive integer, got {value!r}"
                )
        if self.reserve is not None and self.reserve >= self.gpu_memory:
            raise ConfigError(
                f"--gpu-memory {fmt_gib(self.gpu_memory)} GiB leaves nothing beside the "
                f"{fmt_gib(self.reserve)} GiB per GPU kept for CUDA, NCCL and fragmentation"
            )

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nnodes

    def source(self, what: str) -> str:
        return dict(self.sources).get(what, "given")


@dataclass(frozen=True)
class Phase:
    """One GPU phase at its worst pipeline stage."""

    name: str
    stage: int
    items: dict[str, int]
    adds: str  # the item this phase adds to what stays resident

    @property
    def total(self) -> int:
        return sum(self.items.values())


@dataclass
class Problem:
    """Something that does not fit: where, what, by how much."""

    where: str
    item: str
    needed: int
    capacity: int
    message: str


@dataclass
class Preflight:
    """The preflight of one config on one set of machines."""

    config_name: str
    model_name: str
    dims: ModelDims
    layout: ParallelLayout
    hardware: Hardware
    target: Target
    workload: Workload
    numerics: Numerics
    options: Options
    impl: str
    memory: MemoryEstimate
    host: HostMemory
    phases: list[Phase]
    problems: list[Problem]
    suggestions: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    def phase(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config and print its planned memory per GPU in every phase for the "
        "machines below (and --nnodes nodes), then exit (0: fits, 2: does not); builds no model, "
        "starts no process",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="--dry-run: GPUs per node (default: this CUDA machine's, else 8)",
    )
    parser.add_argument(
        "--gpu-memory",
        default=None,
        help="--dry-run: memory per GPU, e.g. 80GiB (default: this CUDA machine's, else 80GiB)",
    )
    parser.add_argument(
        "--host-memory",
        default=None,
        help="--dry-run: host memory per node (default: this CUDA machine's, else 1TiB)",
    )
    parser.add_argument(
        "--no-preflight",
        action="store_true",
        help="on CUDA, launch without the memory preflight",
    )


# -- from the config to the planner's inputs ------------------------------------------------------


def numerics_for(model: ModelConfig, actor: ActorConfig, target: Target) -> tuple[Numerics, str]:
    """What the models hold per parameter and how they compute, as these settings run on
    ``target``; and the layer implementation (local | transformer_engine)."""
    impl = transformer_impl(model.transformer_impl, target, lora=actor.lora.rank > 0)
    kernels = kernel_options(impl, target)
    bf16 = model_dtype(model, target.cuda) == "bfloat16"
    param_bytes = 2 if bf16 else 4
    if impl == "transformer_engine":
        # fp32 TE attention is its unfused backend: it stores the scores
        act = GPU_TE_BF16 if bf16 else replace(GPU_TE_BF16, bytes=4, flash_attention=False)
        label = "Transformer Engine"
    else:
        act = replace(CPU_LOCAL_FP32, bytes=param_bytes)
        label = "megatron local spec, torch SDPA"
    act = replace(act, name=f"{label}, {'bf16' if bf16 else 'fp32'}")
    numerics = Numerics(
        name=f"{'gpu' if target.cuda else 'cpu'}-{'bf16' if bf16 else 'fp32'} ({label})",
        param_bytes=param_bytes,
        grad_bytes=4,  # megatron DDP reduces grads in fp32 (grad_reduce_in_fp32)
        main_param_bytes=4 if bf16 else 0,
        activations=act,
        fused_wgrad=kernels.gradient_accumulation_fusion,
        # megatron takes Transformer Engine's FusedAdam where TE imports (on CUDA)
        fused_adam=target.cuda and target.transformer_engine,
        gloo=not target.cuda,
        # megarl's offload runs megatron's precision-aware optimizer where TE is (the only
        # place it offloads: megarl.gpu_defaults refuses it elsewhere)
        offload_main_params=target.transformer_engine,
    )
    return numerics, impl


def _scored(
    a: AlgorithmConfig, actor: ActorConfig, train_batch_size: int, reference: bool, critic: bool
) -> bool:
    """Whether anything scores the rollout before the update (reference logprobs, values, or
    the actor's old logprobs in a separate forward)."""
    from megarl.trainer.old_log_probs import separate_forward_reasons

    reasons = separate_forward_reasons(a, actor, train_batch_size)
    return reference or critic or bool(reasons)


def _judge_dims(judge: JudgeConfig) -> ModelDims | None:
    """The shape of ``reward.judge.model_path`` (a judge at a URL costs this run no memory)."""
    path = judge.model_path
    return ModelDims.from_pretrained(path) if path else None


def workload_for(
    cfg: RunConfig, layout: ParallelLayout, reward_model: ModelDims | None = None
) -> tuple[Workload, Options]:
    """The planner's workload and options for exactly this config."""
    from megarl.algos.choices import resolve_algorithm_kwargs

    a, r, actor = cfg.algorithm, cfg.rollout, cfg.actor
    critic = "values" in resolve_algorithm_kwargs(cfg.algorithm, cfg.rollout.sampling).adv_inputs
    reference = a.use_kl_loss or a.use_kl_in_reward
    n = r.sampling.n
    rollout_batch = cfg.data.train_batch_size * n
    per_engine = -(-rollout_batch // layout.rollout_dp)
    workload = Workload(
        seq_len=cfg.data.max_prompt_length + r.sampling.max_response_length,
        micro_batch=actor.micro_batch_size,
        global_batch=actor.ppo_mini_batch_size * n,
        algo="ppo" if critic else "grpo",
        reference=reference,
        rollout=True,
        response_len=r.sampling.max_response_length,
        rollout_seqs=max(1, min(r.engine.max_num_seqs, per_engine)),
        gpu_memory_utilization=r.engine.gpu_memory_utilization,
        lora_rank=actor.lora.rank,
        micro_batch_tokens=actor.max_tokens_per_micro_batch,
        output_positions=r.sampling.max_response_length,
        scoring=_scored(a, actor, cfg.data.train_batch_size, reference, critic),
        temperature=r.sampling.temperature,
        samples_per_prompt=n,
        rollout_batch=rollout_batch,
        sleep_level=r.engine.sleep_level,
        reward_model=reward_model,
        record_routes=routing_recorded(cfg.rollout.engine, True),  # counted for MoE models only
        routes_gathered=actor.balance_dp_tokens,
        judge=_judge_dims(cfg.reward.judge),
        judge_len=cfg.reward.judge.max_length,
    )
    roles_offloaded = actor.param_offload and (cfg.ref.param_offload or not reference)
    roles_offloaded = roles_offloaded and (cfg.critic.param_offload or not critic)
    options = Options(
        recompute=cfg.model.recompute,
        sequence_parallel=cfg.parallel.sequence_parallel,
        optimizer_offload=actor.optimizer_offload,
        param_offload=roles_offloaded,
        packing=actor.packing,
    )
    return workload, options


# -- the check --------------------------------------------------------------------------------------


def _gpu_phases(memory: MemoryEstimate) -> list[Phase]:
    """Each displayed phase at its worst stage (``update``: the largest of the train phases)."""
    out = []
    for name in GPU_PHASES:
        sources = UPDATE_PHASES if name == "update" else ("setup" if name == "build" else name,)
        best: tuple[int, int, str] | None = None
        for stage in memory.stages:
            for src in sources:
                if src in stage.phases and (best is None or stage.phases[src] > best[0]):
                    best = (stage.phases[src], stage.stage, src)
        if best is None:
            continue
        _, k, src = best
        items = {i: v for i, v in memory.stages[k].phase_items[src].items() if v}
        out.append(Phase(name, k, items, PHASE_ITEMS[src]))
    return out


def _problems(
    phases: list[Phase], memory: MemoryEstimate, host: HostMemory, hw: Hardware, w: Workload
) -> list[Problem]:
    out = []
    for p in phases:
        if p.total <= hw.gpu_memory:
            continue
        added = p.items.get(p.adds, 0)
        resident = p.total - added
        if p.name == "startup":
            message = (
                f"startup needs {fmt_gib(p.total)} GiB per GPU > {fmt_gib(hw.gpu_memory)} GiB: "
                f"vLLM starts only with rollout.engine.gpu_memory_utilization={w.gpu_memory_utilization}"
                f" x {fmt_gib(hw.gpu_memory)} = {fmt_gib(added)} GiB free, and the models hold "
                f"{fmt_gib(resident)} GiB by then (stage {p.stage})"
            )
        else:
            message = (
                f"{p.name} needs {fmt_gib(p.total)} GiB per GPU > {fmt_gib(hw.gpu_memory)} GiB at "
                f"pipeline stage {p.stage}: its {p.adds} ({fmt_gib(added)} GiB) do not fit beside "
                f"the {fmt_gib(resident)} GiB resident ({_largest(p.items, p.adds)})"
            )
        out.append(Problem(p.name, p.adds, p.total, hw.gpu_memory, message))
    kv = min((s.kv_capacity_tokens or 0) for s in memory.stages)
    if w.rollout and w.gpu_memory_utilization is not None and kv < w.seq_len:
        out.append(
            Problem(
                "rollout",
                "kv_cache",
                w.seq_len,
                kv,
                f"vLLM's KV cache holds {kv} tokens, fewer than one {w.seq_len}-token sequence "
                "(data.max_prompt_length + rollout.sampling.max_response_length): vLLM refuses to start",
            )
        )
    bytes_, phase, node = host.node_peak()
    if bytes_ > hw.host_memory:
        items = host.rank_items(phase)
        out.append(
            Problem(
                f"host {phase}",
                max(items, key=items.__getitem__),
                bytes_,
                hw.host_memory,
                f"host memory in {phase}: {fmt_gib(bytes_)} GiB on node {node} > "
                f"{fmt_gib(hw.host_memory)} GiB ({_largest(items, '')} per rank)",
            )
        )
    return out


def _largest(items: dict[str, int], skip: str) -> str:
    top = sorted(((v, k) for k, v in items.items() if k != skip and v), reverse=True)[:3]
    return ", ".join(f"{k} {fmt_gib(v)}" for v, k in top)


def preflight(
    cfg: RunConfig,
    dims: ModelDims,
    hardware: Hardware,
    target: Target,
    reward_model: ModelDims | None = None,
    config_name: str = "",
    model_name: str = "",
    suggest: bool = True,
) -> Preflight:
    """The preflight of ``cfg`` on ``hardware``; with ``suggest``, when something does not fit,
    the settings that would make it fit (:func:`suggestions`)."""
    layout = ParallelLayout.for_settings(hardware.world, cfg.parallel)
    workload, options = workload_for(cfg, layout, reward_model)
    numerics, impl = numerics_for(cfg.model, cfg.actor, target)
    memory = estimate_memory(
        dims, layout, workload, numerics, options, hardware.gpu_memory, hardware.reserve
    )
    host = estimate_host_memory(dims, layout, workload, numerics, options, hardware.gpus_per_node)
    phases = _gpu_phases(memory)
    pf = Preflight(
        config_name=config_name,
        model_name=model_name or cfg.model.path,
        dims=dims,
        layout=layout,
        hardware=hardware,
        target=target,
        workload=workload,
        numerics=numerics,
        options=options,
        impl=impl,
        memory=memory,
        host=host,
        phases=phases,
        problems=_problems(phases, memory, host, hardware, workload),
    )
    if suggest and not pf.fits:
        pf.suggestions = suggestions(pf, cfg, target, reward_model)
    return pf


# -- what would make it fit -----------------------------------------------------------------------


def with_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """A copy of ``cfg`` with dotted ``key=value`` overrides of scalar settings applied, each
    value read as the type the setting holds (the preflight's own candidates; user overrides go
    through :func:`megarl.config.load_config`)."""
    out = copy.deepcopy(cfg)
    for item in overrides:
        key, _, text = item.partition("=")
        *path, name = key.split(".")
        node = out
        for part in path:
            node = getattr(node, part)
        setattr(node, name, _typed(text, getattr(node, name)))
    return out


def _typed(text: str, like: object) -> object:
    if isinstance(like, bool):
        return text == "true"
    if isinstance(like, float):
        return float(text)
    if isinstance(like, int) or like is None:
        return int(text)
    return text


def _halvings(value: int, floor: int) -> list[int]:
    out = []
    while value // 2 >= floor and value > 1:
        value //= 2
        out.append(value)
    return out


def _candidates(
    pf: Preflight, model: ModelConfig, a: ActorConfig, rollout: RolloutConfig, par: ParallelConfig
) -> list[list[str]]:
    """Setting changes to try, cheapest first, for what does not fit."""
    what = {p.item for p in pf.problems} | {p.where for p in pf.problems}
    out: list[list[str]] = []
    activations = "activations" in what
    if activations and model.recompute != "full":
        out.append(["model.recompute=full"])
    if activations and a.max_tokens_per_micro_batch is not None:
        seq = pf.workload.seq_len
        out += [
            [f"actor.max_tokens_per_micro_batch={t}"]
            for t in _halvings(a.max_tokens_per_micro_batch, seq)
        ]
    elif activations:
        out += [[f"actor.micro_batch_size={b}"] for b in _halvings(a.micro_batch_size, 1)]
    vllm = bool(what & {"startup", "rollout", "kv_cache"})
    if vllm:
        u = rollout.engine.gpu_memory_utilization
        steps = [round(x / 100, 2) for x in range(5, 100, 5)]
        lower = [x for x in reversed(steps) if x < u]
        higher = [x for x in steps if x > u]
        out += [[f"rollout.engine.gpu_memory_utilization={x}"] for x in (lower + higher)]
    if a.optimizer_offload < 1.0:
        out.append(["actor.optimizer_offload=1.0"])
    if "rollout" in what and not a.param_offload:
        out.append(
            ["actor.param_offload=true", "ref.param_offload=true", "critic.param_offload=true"]
        )
    if any(p.where.startswith("host") for p in pf.problems) and rollout.engine.sleep_level == 1:
        out.append(["rollout.engine.sleep_level=2"])
    node = pf.hardware.gpus_per_node
    for tp in (2, 4, 8, 16):
        if par.tp < tp <= node and node % tp == 0:
            out.append([f"parallel.tp={tp}"])
    for pp in (2, 4, 8):
        if par.pp < pp and pf.hardware.world % (par.tp * pp) == 0:
            out.append([f"parallel.pp={pp}"])
    return out


def _try(
    cfg: RunConfig,
    overrides: list[str],
    dims: ModelDims,
    hardware: Hardware,
    target: Target,
    reward_model: ModelDims | None,
) -> Preflight | None:
    try:
        changed = with_overrides(cfg, overrides)
        validate(changed, hardware.world)
        ParallelLayout.for_settings(hardware.world, changed.parallel).check_model(dims.shape)
        return preflight(changed, dims, hardware, target, reward_model, suggest=False)
    except MegarlError:  # a change the config or the layout refuses is no suggestion
        return None


def suggestions(
    pf: Preflight,
    cfg: RunConfig,
    target: Target,
    reward_model: ModelDims | None = None,
    limit: int = 3,
) -> list[list[str]]:
    """Override sets under which every phase fits, cheapest first: single changes, then each of
    the first candidates combined with the others."""
    found: list[list[str]] = []
    candidates = _candidates(pf, cfg.model, cfg.actor, cfg.rollout, cfg.parallel)
    seen_keys: set[str] = set()

    def consider(overrides: list[str]) -> None:
        key = overrides[0].split("=")[0]
        if len(overrides) == 1 and key in seen_keys:
            return  # the first (mildest) fitting value of a knob is enough
        result = _try(cfg, overrides, pf.dims, pf.hardware, target, reward_model)
        if result is not None and result.fits:
            found.append(overrides)
            if len(overrides) == 1 or key.startswith("rollout.gpu"):
                seen_keys.add(key)

    for c in candidates:
        if len(found) >= limit:
            return found
        consider(c)
    if found:
        return found
    for i, first in enumerate(candidates[:6]):
        for second in candidates[i + 1 :]:
            if first[0].split("=")[0] == second[0].split("=")[0]:
                continue
            if len(found) >= limit:
                return found
            consider([*first, *second])
    return found


# -- what it prints ------------------------------------------------------------------------------


def _cell(v: int) -> str:
    return fmt_gib(v) if v else "-"


def _gpu_table(pf: Preflight) -> list[str]:
    used = [i for i in ITEM_ORDER if any(p.items.get(i) for p in pf.phases)]
    head = ["phase", "stage", *used, "total", "status"]
    rows = []
    for p in pf.phases:
        status = (
            "ok"
            if p.total <= pf.hardware.gpu_memory
            else (f"OVER by {fmt_gib(p.total - pf.hardware.gpu_memory)}")
        )
        rows.append(
            [
                p.name,
                str(p.stage),
                *(_cell(p.items.get(i, 0)) for i in used),
                fmt_gib(p.total),
                status,
            ]
        )
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(head)]
    lines = ["  ".join(h.ljust(widths[c]) for c, h in enumerate(head)).rstrip()]
    lines += ["  ".join(v.ljust(widths[c]) for c, v in enumerate(r)).rstrip() for r in rows]
    return lines


ITEM_ORDER = (
    "weights",
    "grads",
    "optimizer",
    "reference",
    "critic",
    "reward_model",
    "activations",
    "transient",
    "scores",
    "rollout",
    "reserve",
)


def _hardware_line(pf: Preflight) -> str:
    hw = pf.hardware

    def src(what: str) -> str:
        s = hw.source(what)
        return "" if s == "given" else f" ({s})"

    how = "given" if hw.reserve is not None else "from the layout, below"
    return (
        f"hardware: {hw.nnodes} node(s) x {hw.gpus_per_node} GPUs{src('gpus')} of "
        f"{fmt_gib(hw.gpu_memory)} GiB{src('gpu_memory')}, host {fmt_gib(hw.host_memory)} GiB "
        f"per node{src('host_memory')}; {fmt_gib(pf.memory.reserve.total)} GiB per GPU kept for "
        f"CUDA, NCCL and fragmentation ({how})"
    )


def _kernels_line(pf: Preflight) -> str:
    k = kernel_options(pf.impl, pf.target)
    fused = [
        n
        for n, on in (
            ("rope fusion", k.apply_rope_fusion),
            ("weight-gradient fusion", k.gradient_accumulation_fusion),
            ("overlapped grad reduce", k.overlap_grad_reduce),
        )
        if on
    ]
    return f"numerics: {pf.numerics.name}" + (f"; {', '.join(fused)}" if fused else "")


def _micro_batch_line(w: Workload, packing: bool) -> str:
    if w.micro_batch_tokens is not None:
        kind = "real tokens, packed" if packing else "padded tokens"
        mb = f"micro-batches of <= {w.micro_batch_tokens} {kind}"
    else:
        mb = f"micro-batches of {w.micro_batch} sequences" + (" (packed)" if packing else "")
    return (
        f"sizes: sequences <= {w.seq_len} tokens (response {w.response_tokens}); {mb}; "
        f"{w.global_batch} sequences per optimizer step, {w.rollout_sequences} per rollout"
    )


def _kv_line(pf: Preflight) -> str | None:
    w = pf.workload
    tokens = min((s.kv_capacity_tokens or 0) for s in pf.memory.stages)
    if not w.rollout or w.gpu_memory_utilization is None:
        return None
    kv = tokens * kv_bytes_per_token(pf.dims, pf.layout.rollout_tp)
    full = tokens // max(w.seq_len, 1)
    return (
        f"vLLM (TP{pf.layout.rollout_tp}, {pf.layout.rollout_dp} engines): KV cache "
        f"{fmt_gib(kv)} GiB per GPU = {tokens:,} tokens, {full} sequences of {w.seq_len} tokens "
        f"fit at once; it schedules up to {w.rollout_seqs} (rollout.engine.max_num_seqs)"
    )


def _host_lines(pf: Preflight) -> list[str]:
    h, hw = pf.host, pf.hardware
    per_node = min(hw.gpus_per_node, pf.layout.world_size)
    lines = [f"host memory per node ({per_node} ranks), GiB, of {fmt_gib(hw.host_memory)}:"]
    for phase in ("rollout", "training", "save"):
        total = max(n[phase] for n in h.nodes)
        items = {k: v for k, v in h.rank_items(phase).items() if v}
        detail = ", ".join(f"{k} {fmt_gib(v)}" for k, v in items.items()) or "nothing"
        status = "ok" if total <= hw.host_memory else "OVER"
        lines.append(f"  {phase:<9} {fmt_gib(total):>7}  {status:<4} (largest rank: {detail})")
    return lines


def format_report(pf: Preflight) -> str:
    d, w = pf.dims, pf.workload
    lines = [
        f"megarl preflight: {pf.config_name or 'config'} on {pf.layout} "
        f"(vLLM TP{pf.layout.rollout_tp})",
        f"model: {pf.model_name} ({d.num_parameters / 1e9:.2f}B params, {d.num_layers} layers)",
        _hardware_line(pf),
        _kernels_line(pf),
        _micro_batch_line(w, pf.options.packing),
        f"options: recompute {pf.options.recompute}, optimizer offload "
        f"{float(pf.options.optimizer_offload):g}, param offload "
        f"{'on' if pf.options.param_offload else 'off'}, vLLM sleep level {w.sleep_level}",
        "",
        f"GPU memory per GPU, GiB (of {fmt_gib(pf.hardware.gpu_memory)}; the worst pipeline "
        "stage of each phase):",
        *_gpu_table(pf),
    ]
    kv = _kv_line(pf)
    if kv:
        lines.append(kv)
    lines += ["", *pf.memory.reserve.lines()]
    lines += ["", *_host_lines(pf), ""]
    if pf.fits:
        peak = pf.peak
        lines.append(
            f"preflight: every phase fits; peak {fmt_gib(peak.total)} of "
            f"{fmt_gib(pf.hardware.gpu_memory)} GiB per GPU in {peak.name}"
        )
    else:
        lines.append("preflight: DOES NOT FIT")
        lines += [f"  - {p.message}" for p in pf.problems]
        if pf.suggestions:
            lines.append("settings under which every phase fits (each checked):")
            lines += [f"  {' '.join(s)}" for s in pf.suggestions]
        else:
            lines.append(
                "  no single setting change fits; use GPUs with more memory (--gpu-memory) or "
                "more of them (--nnodes), or see `megarl plan` for other layouts"
            )
    lines += pf.notes
    return "\n".join(lines)


def summary(pf: Preflight) -> str:
    """One line for the launch log."""
    if pf.fits:
        peak = pf.peak
        return (
            f"megarl preflight: fits on {pf.layout}: peak {fmt_gib(peak.total)} of "
            f"{fmt_gib(pf.hardware.gpu_memory)} GiB per GPU in {peak.name} "
            "(megarl train --dry-run shows every phase; --no-preflight skips this check)"
        )
    return format_report(pf)
