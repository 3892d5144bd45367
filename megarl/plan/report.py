"""A plan as a table for people and as JSON for tools."""

from __future__ import annotations

import json
import math

from megarl.models.dims import ModelDims
from megarl.plan.memory import Numerics
from megarl.plan.params import stage_params
from megarl.plan.reshard import reshard_figures
from megarl.plan.search import Evaluated, PlanResult
from megarl.plan.units import GIB, fmt_gib
from megarl.plan.workload import Workload

COLUMNS = (
    ("#", 2),
    ("layout", 13),
    ("itp", 3),
    ("recomp", 6),
    ("offload", 7),
    ("weights", 7),
    ("grads", 6),
    ("optim", 6),
    ("act", 6),
    ("ref+cr", 6),
    ("vllm", 6),
    ("start", 6),
    ("train", 6),
    ("rollout", 7),
    ("peak", 6),
    ("step s", 7),
    ("bubble", 6),
    ("reshard", 7),
)
TRAIN_PHASES = ("setup", "forward-backward", "grad-sync", "optimizer-step")


def _yes(flag: bool | float) -> str:
    return "yes" if flag else "no"


def _row(i: int, e: Evaluated, result: PlanResult) -> list[str]:
    """Train-phase items of the worst stage, vLLM's part of the rollout phase, phase totals
    (``start``: the models beside vLLM when it starts; ``train``: the update's phases), and what
    each rank receives per step when the actor is resharded into vLLM."""
    worst = e.memory.worst
    train = worst.phase_items["forward-backward"]
    rollout = worst.phase_items.get("rollout", {})
    train_peak = max(worst.phases[p] for p in TRAIN_PHASES if p in worst.phases)
    bubble = e.time.parts["bubble"] / max(e.time.total, 1e-12)
    return [
        str(i),
        _layout_name(e.layout),
        str(e.layout.rollout_tp),
        e.options.recompute,
        _yes(e.options.optimizer_offload),
        fmt_gib(train.get("weights", 0)),
        fmt_gib(train.get("grads", 0)),
        fmt_gib(train.get("optimizer", 0)),
        fmt_gib(train.get("activations", 0)),
        fmt_gib(train.get("reference", 0) + train.get("critic", 0)),
        fmt_gib(rollout.get("rollout", 0)),
        fmt_gib(worst.phases.get("startup", 0)),
        fmt_gib(train_peak),
        fmt_gib(worst.phases.get("rollout", 0)),
        fmt_gib(worst.peak),
        f"{e.time.total:.1f}",
        f"{bubble:.0%}",
        fmt_gib(
            int(
                reshard_figures(result.dims, e.layout, result.cluster.gpus_per_node)[
                    "recv_bytes_per_rank"
                ]
            )
        ),
    ]


def _layout_name(layout) -> str:
    """``TP8xPP8xDP2``, with ``*`` when the pipeline split is uneven (listed below the table)."""
    return str(layout) + ("*" if layout.pp_layers else "")


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(w, *(len(r[i]) for r in rows)) if rows else w for i, (_, w) in enumerate(COLUMNS)]
    header = "  ".join(name.ljust(widths[i]) for i, (name, _) in enumerate(COLUMNS))
    lines = [header.rstrip()]
    for r in rows:
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
    return lines


def _roles(result: PlanResult) -> str:
    w = result.workload
    roles = [f"LoRA actor (rank {w.lora_rank}, all-linear)" if w.lora_rank else "actor"]
    if w.reference:
        roles.append("reference (the LoRA actor's base)" if w.lora_rank else "reference")
    if w.critic:
        roles.append("critic")
    if w.rollout:
        roles.append("vLLM rollout")
    return " + ".join(roles)


def format_text(result: PlanResult, top: int = 5) -> str:
    c, w, d = result.cluster, result.workload, result.dims
    lines = [
        f"megarl plan: {result.model} ({d.num_parameters / 1e9:.2f}B params, {d.num_layers} "
        f"layers, {d.num_attention_heads} heads / {d.num_kv_heads} KV heads) on {c.gpus} x "
        f"{fmt_gib(c.gpu_memory)} GiB GPUs ({c.nodes} node(s) of {c.node_size})",
        f"workload: {w.algo}, {_roles(result)}; seq {w.seq_len} (response {w.response_tokens}), "
        f"micro-batch {w.micro_batch}, {w.global_batch} sequences per optimizer step; "
        f"{result.numerics.name} weights, reserve "
        + (
            f"{fmt_gib(c.reserve)} GiB per GPU (given)"
            if c.reserve is not None
            else "per layout (CUDA context, its NCCL communicators, fragmentation)"
        ),
        "memory in GiB per GPU at the worst pipeline stage's peak phase; step time from the "
        "cost model in megarl/plan/cost.py; reshard: GiB each rank receives per step into vLLM "
        "(docs/resharding.md)",
        "",
    ]
    if result.feasible:
        shown = result.feasible[:top]
        lines.append(f"Top {len(shown)} of {len(result.feasible)} feasible training layouts:")
        lines += _table([_row(i + 1, e, result) for i, e in enumerate(shown)])
        for e in shown:
            if e.layout.pp_layers:
                lines.append(
                    f"* {e.layout}: uneven pipeline split, parallel.pp_layers = "
                    f"{list(e.layout.pp_layers)}"
                )
        if d.is_moe:
            lines += [_moe_line(e, d) for e in shown]
        lines += _overrides_lines(result, shown)
    else:
        lines.append(
            f"NOTHING FITS: no layout of {result.model} runs on {c.gpus} x "
            f"{fmt_gib(c.gpu_memory)} GiB GPUs with this workload."
        )
        for s in result.suggestions:
            lines.append(f"  - {s}")
    groups = result.rejected_by_reason()
    if groups:
        n_layouts = len(result.rejected)
        lines += ["", f"Infeasible training layouts ({n_layouts}), by reason:"]
        for reason, entries in groups.items():
            lines.append(f"- {reason}")
            for r in entries:
                key = f"TP{r.layout.tp}xPP{r.layout.pp}xDP{r.layout.dp}"
                if r.detail:
                    key += f" (smallest: infer_tp {r.layout.rollout_tp}"
                    knobs = _knob_words(r.evaluated)
                    key += f", {knobs})" if knobs else ")"
                lines.append(f"    {key}" + (f": {r.detail}" if r.detail else ""))
    for reason, itps in result.infer_tp_rejected.items():
        lines.append(f"- rollout infer_tp {', '.join(map(str, itps))} not used: {reason}")
    return "\n".join(lines)


def _overrides_lines(result: PlanResult, shown: list[Evaluated]) -> list[str]:
    """The ``megarl train`` overrides of each shown layout: the workload's, then its own."""
    common = workload_overrides(result.workload, result.numerics)
    lines = [
        "",
        "Overrides (megarl train CONFIG ...): every layout above takes",
        "  " + " ".join(common),
    ]
    for i, e in enumerate(shown):
        own = config_overrides(e, result.workload, result.cluster.gpu_memory)
        lines.append(f"  #{i + 1}: {' '.join(own)}")
    return lines


def _moe_line(e: Evaluated, d: ModelDims) -> str:
    """Experts per rank, their share of the worst stage's weights and the all-to-all time."""

    lay = e.layout
    worst = e.memory.worst
    layers = lay.layers_per_stage(d.num_layers)[worst.stage]
    p = stage_params(d, lay.tp, lay.pp, worst.stage, layers, "actor", lay.ep)
    share = p.experts / max(p.total, 1)
    return (
        f"  {lay}: {lay.experts_per_rank(d.num_experts)} of {d.num_experts} experts per rank "
        f"({share:.0%} of its weights, {fmt_gib(p.experts * 2)} GiB bf16), all-to-all "
        f"{e.time.parts.get('ep_comm', 0.0):.2f} s/step"
    )


def _knob_words(e: Evaluated | None) -> str:
    if e is None:
        return ""
    words = [
        w
        for w, on in (
            (f"{e.options.recompute} recompute", e.options.recompute != "none"),
            ("optimizer offload", e.options.optimizer_offload),
        )
        if on
    ]
    return ", ".join(words)


def _gib(n: float) -> float:
    return round(n / GIB, 3)


def workload_overrides(w: Workload, numerics: Numerics) -> list[str]:
    """The ``megarl train`` settings of the plan's workload, the same for every layout: batch
    sizes (one rollout per optimizer step, as the cost model assumes), lengths, micro-batching,
    dtype, algorithm and LoRA."""
    n = w.samples_per_prompt
    out = [
        f"data.train_batch_size={w.rollout_sequences // n}",
        f"actor.ppo_mini_batch_size={w.global_batch // n}",
        "actor.ppo_epochs=1",
        f"rollout.sampling.n={n}",
        f"data.max_prompt_length={w.seq_len - w.response_tokens}",
        f"rollout.sampling.max_response_length={w.response_tokens}",
        f"model.dtype={'bfloat16' if numerics.param_bytes == 2 else 'float32'}",
        f"rollout.engine.max_num_seqs={w.rollout_seqs}",
    ]
    if w.micro_batch_tokens is not None:
        out.append(f"actor.max_tokens_per_micro_batch={w.micro_batch_tokens}")
    else:
        out += [f"actor.micro_batch_size={w.micro_batch}", "actor.max_tokens_per_micro_batch=null"]
    ref = str(w.reference).lower()
    if w.critic:
        out += [
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_loss=false",
            f"algorithm.use_kl_in_reward={ref}",
        ]
    else:
        out += [
            "algorithm.adv_estimator=grpo",
            f"algorithm.use_kl_loss={ref}",
            "algorithm.use_kl_in_reward=false",
        ]
    out.append(f"actor.lora.rank={w.lora_rank}")
    if w.gpu_memory_utilization is not None:
        out.append(f"rollout.engine.gpu_memory_utilization={w.gpu_memory_utilization}")
    return out


def _vllm_share(e: Evaluated, gpu_memory: int) -> float:
    """The ``rollout.engine.gpu_memory_utilization`` that gives vLLM what the plan sized it at (weights,
    the KV cache of ``--rollout-seqs`` sequences, workspace), rounded up to a hundredth."""
    vllm = e.memory.worst.phase_items.get("rollout", {}).get("rollout", 0)
    return min(1.0, math.ceil(100 * vllm / gpu_memory) / 100)


def config_overrides(e: Evaluated, w: Workload | None = None, gpu_memory: int = 0) -> list[str]:
    """The ``megarl train`` overrides that build this candidate's layout and knobs (the plan's
    optimizer offload moves all of it: ``actor.optimizer_offload=1.0``; its parameter offload is
    the actor's, the reference's and the critic's); with the workload ``w``, also vLLM's share
    of the GPU where the plan sized vLLM by ``--rollout-seqs``."""
    out = [
        f"parallel.tp={e.layout.tp}",
        f"parallel.pp={e.layout.pp}",
        f"parallel.infer_tp={e.layout.rollout_tp}",
        f"model.recompute={e.options.recompute}",
        f"actor.optimizer_offload={1.0 if e.options.optimizer_offload else 0.0}",
        f"actor.packing={str(e.options.packing).lower()}",
    ]
    if e.options.param_offload:
        out += [f"{role}.param_offload=true" for role in ("actor", "ref", "critic")]
    if e.layout.ep > 1:
        out.append(f"parallel.ep={e.layout.ep}")
    if e.layout.pp_layers:
        out.append(f"parallel.pp_layers=[{','.join(map(str, e.layout.pp_layers))}]")
    if e.options.sequence_parallel is not None and e.layout.tp > 1:
        out.append(f"parallel.sequence_parallel={str(e.options.sequence_parallel).lower()}")
    if w is not None and w.rollout and w.gpu_memory_utilization is None and gpu_memory:
        out.append(f"rollout.engine.gpu_memory_utilization={_vllm_share(e, gpu_memory)}")
    return out


def _evaluated_json(e: Evaluated, result: PlanResult) -> dict[str, object]:
    worst = e.memory.worst
    w = result.workload
    overrides = workload_overrides(w, result.numerics) + config_overrides(
        e, w, result.cluster.gpu_memory
    )
    return {
        "layout": str(e.layout),
        "tp": e.layout.tp,
        "pp": e.layout.pp,
        "dp": e.layout.dp,
        "ep": e.layout.ep,
        "pp_layers": list(e.layout.pp_layers) if e.layout.pp_layers else None,
        "infer_tp": e.layout.rollout_tp,
        "recompute": e.options.recompute,
        "optimizer_offload": e.options.optimizer_offload,
        "param_offload": e.options.param_offload,
        "packing": e.options.packing,
        "overrides": overrides,
        "peak_gib": _gib(worst.peak),
        "reserve_gib": {name: _gib(v) for name, v in e.memory.reserve.items},
        "peak_stage": worst.stage,
        "peak_phase": worst.phase,
        "items_gib": {k: _gib(v) for k, v in worst.items.items()},
        "stages": [
            {"stage": s.stage, "phases_gib": {k: _gib(v) for k, v in s.phases.items()}}
            for s in e.memory.stages
        ],
        "kv_capacity_tokens": worst.kv_capacity_tokens,
        "step_time_s": round(e.time.total, 3),
        "time_parts_s": {k: round(v, 3) for k, v in e.time.parts.items()},
        # bytes per step into the rollout engine (megarl.plan.reshard)
        "reshard": reshard_figures(result.dims, e.layout, result.cluster.gpus_per_node),
    }


def to_json(result: PlanResult) -> dict[str, object]:
    c, w, d = result.cluster, result.workload, result.dims
    groups = result.rejected_by_reason()
    return {
        "model": {
            "name": result.model,
            "parameters": d.num_parameters,
            "hidden_size": d.hidden_size,
            "num_layers": d.num_layers,
            "num_attention_heads": d.num_attention_heads,
            "num_kv_heads": d.num_kv_heads,
            "ffn_hidden_size": d.ffn_hidden_size,
            "vocab_size": d.vocab_size,
            "tie_word_embeddings": d.tie_word_embeddings,
            "qkv_bias": d.qkv_bias,
            "family": d.family,
            "qk_layernorm": d.qk_layernorm,
            "num_experts": d.num_experts,
            "moe_topk": d.moe_topk,
            "moe_ffn_hidden_size": d.moe_ffn_hidden_size,
        },
        "cluster": {
            "gpus": c.gpus,
            "gpus_per_node": c.gpus_per_node,
            "gpu_memory_gib": _gib(c.gpu_memory),
            "reserve_gib": _gib(c.reserve) if c.reserve is not None else None,
        },
        "workload": {
            "algo": w.algo,
            "seq_len": w.seq_len,
            "response_len": w.response_tokens,
            "micro_batch": w.micro_batch,
            "micro_batch_tokens": w.micro_batch_tokens,
            "samples_per_prompt": w.samples_per_prompt,
            "global_batch": w.global_batch,
            "reference": w.reference,
            "lora_rank": w.lora_rank,
            "critic": w.critic,
            "rollout": w.rollout,
            "rollout_seqs": w.rollout_seqs,
            "gpu_memory_utilization": w.gpu_memory_utilization,
        },
        "numerics": result.numerics.name,
        "nothing_fits": result.nothing_fits,
        "feasible": [_evaluated_json(e, result) for e in result.feasible],
        "variants": {
            f"TP{tp}xPP{pp}" + (f"xEP{ep}" if ep > 1 else ""): [
                _evaluated_json(e, result) for e in v
            ]
            for (tp, pp, ep), v in result.variants.items()
        },
        "infeasible": [
            {
                "reason": reason,
                "layouts": [
                    {
                        "layout": f"TP{r.layout.tp}xPP{r.layout.pp}xDP{r.layout.dp}",
                        "pp_layers": list(r.layout.pp_layers) if r.layout.pp_layers else None,
                        "infer_tp": r.layout.infer_tp,
                        "recompute": r.evaluated.options.recompute if r.evaluated else None,
                        "optimizer_offload": (
                            r.evaluated.options.optimizer_offload if r.evaluated else None
                        ),
                        "detail": r.detail,
                        "peak_gib": _gib(r.evaluated.memory.peak) if r.evaluated else None,
                    }
                    for r in entries
                ],
            }
            for reason, entries in groups.items()
        ],
        "infer_tp_rejected": [
            {"reason": reason, "infer_tp": itps}
            for reason, itps in result.infer_tp_rejected.items()
        ],
        "suggestions": result.suggestions,
    }


def format_json(result: PlanResult) -> str:
    return json.dumps(to_json(result), indent=2)
