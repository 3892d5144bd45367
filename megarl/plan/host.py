"""Host (CPU) memory of each rank and node, phase by phase: what megarl keeps off the GPUs.

Per rank of pipeline stage k (P: the stage's parameters on this TP rank, S: this rank's
distributed-optimizer shard of them):

- always: the optimizer offload's share f (``actor.optimizer_offload``) of the shard lives on
  the host in megatron's hybrid optimizer (``optimizer/cpu_offloading/hybrid_optimizer.py``):
  fp32 master params, Adam's m and v and an fp32 copy of the grads, 16 bytes per parameter of
  f x S; the grads' copies are pinned, and so is each parameter's 16-bit copy the optimizer
  makes on its way to fp32 (freed, but kept pinned by torch's host allocator);
- rollout: megarl's hybrid engine moves the actor's Adam m and v (the GPU's part) to pinned host
  memory while vLLM generates; with param offload the actor's weights, master params and moments,
  the reference's weights and the critic's weights, grads and optimizer state go there too;
- training (scoring, update): vLLM asleep copies its runtime and CUDA-graph pools to pinned host
  memory at every sleep level (vLLM 0.32's ``sleep_mode_backend``: tags ``runtime`` and
  ``cudagraph``), counted as its workspace; at ``sleep_level`` 1 also its weights (its TP shard,
  bf16); at level 2 it drops them;
- save: + the checkpoint's staging. megarl writes the ``fully_reshardable`` optimizer format,
  each rank its own shard of the state without a gather (:data:`OPTIMIZER_SAVE`, see
  :func:`optimizer_staging`), and each rank stages the weights it writes (DP rank 0 of each TP x
  PP shard; megatron's default strategy saves a replicated tensor from its first replica).

Pinned memory is counted as torch's caching host allocator takes it: each block rounded up to a
power of two (:mod:`megarl.plan.pinned`), a block per tensor (per parameter's optimizer state,
per vLLM weight) or per buffer (megatron's contiguous param and grad buffers).

A node's host memory is the sum over the ranks it holds (consecutive global ranks, megatron's
TP-fastest order), so a layout whose DP ranks share a node counts each of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.plan.lora import lora_layer_params
from megarl.plan.memory import (
    VLLM_WORKSPACE,
    Numerics,
    Options,
    judge_weight_bytes,
    optimizer_shard_elements,
    routes_bytes,
    vllm_weight_bytes,
)
from megarl.plan.params import stage_params, stage_tensor_numels
from megarl.plan.pinned import pinned_bytes, pinned_ratio
from megarl.plan.workload import Workload

# Where a fully_reshardable save gathers the distributed optimizer's state, per rank:
# "all": every DP rank receives its TP x PP shard's whole state (megatron's default exchange);
# "dp0": only DP rank 0 does (megatron's memory-efficient exchange); "shard": each rank stages
# only its own shard: what megarl/run/checkpointing.py does (megarl/run/optimizer_shards.py).
OPTIMIZER_SAVE = "shard"
HOST_PHASES = ("rollout", "training", "save")
OFFLOADED_BYTES = 16  # per parameter of megatron's hybrid optimizer on the host (see above)


def optimizer_staging(form: str, state_bytes: int, shard_bytes: int, dp_rank: int) -> int:
    """Host bytes of the optimizer state one rank stages for a save (``state_bytes``: its TP x PP
    shard's whole state, ``shard_bytes``: its own DP shard of it)."""
    if form == "all":
        return state_bytes
    if form == "dp0":
        return state_bytes if dp_rank == 0 else 0
    if form == "shard":
        return shard_bytes
    raise ValueError(f"unknown optimizer save form {form!r}")


@dataclass
class HostMemory:
    """Host bytes per rank (by stage and DP rank: ``ranks[(stage, dp_rank)]``) and per node."""

    ranks: dict[tuple[int, int], dict[str, dict[str, int]]]
    nodes: list[dict[str, int]]  # per node: phase -> bytes
    notes: list[str] = field(default_factory=list)

    def node_peak(self) -> tuple[int, str, int]:
        """(bytes, phase, node) of the largest node phase."""
        best = (0, HOST_PHASES[0], 0)
        for i, phases in enumerate(self.nodes):
            for phase, value in phases.items():
                if value > best[0]:
                    best = (value, phase, i)
        return best

    def rank_items(self, phase: str) -> dict[str, int]:
        """The items of the rank with the most host memory in ``phase``."""
        return max((r[phase] for r in self.ranks.values()), key=lambda items: sum(items.values()))


def _rank_host(
    dims: ModelDims,
    layout: ParallelLayout,
    w: Workload,
    num: Numerics,
    opts: Options,
    stage: int,
    dp_rank: int,
) -> dict[str, dict[str, int]]:
    tp, pp, dp, ep = layout.tp, layout.pp, layout.dp, layout.ep
    layers = layout.layers_per_stage(dims.num_layers)[stage]
    p = stage_params(dims, tp, pp, stage, layers, "actor", ep)
    adapters = layers * lora_layer_params(dims, tp, w.lora_rank) or None
    shard = optimizer_shard_elements(p, dp, ep, adapters)
    f = float(opts.optimizer_offload)
    opt_state = num.main_param_bytes + num.adam_bytes
    saved = 4 + num.adam_bytes  # a save writes fp32 params, m and v (fp32 weights: the weights)
    weights = (p.total + (adapters or 0)) * num.param_bytes
    # one pinned block per parameter tensor: what rounding each per-tensor copy takes (pinned
    # host memory is CUDA's: on a CPU target the copies are plain tensors)
    pinned = not num.gloo
    numels = stage_tensor_numels(dims, tp, pp, stage, layers, ep)
    fp32_ratio = pinned_ratio(n * 4 for n in numels) if pinned else 1.0
    param_ratio = pinned_ratio(n * num.param_bytes for n in numels) if pinned else 1.0
    block = pinned_bytes if pinned else int
    offloaded = int(f * shard * OFFLOADED_BYTES)
    if f:  # the hybrid optimizer's pinned blocks (module doc), beyond the bytes asked
        if num.offload_main_params:  # pinned: the grad copies, the cached 16-bit copies
            offloaded += int(f * shard * (4 * (fp32_ratio - 1) + num.param_bytes * param_ratio))
        else:  # pinned: the grad copies and the fp32 params it steps
            offloaded += int(f * shard * 8 * (fp32_ratio - 1))
    moments_gpu = int((1 - f) * shard * num.adam_bytes)
    main_on_gpu = (1 - f) if num.offload_main_params else 1.0
    main_gpu = int(main_on_gpu * shard * num.main_param_bytes)
    ref = 0
    critic = 0
    critic_state = 0
    critic_shard = 0
    if w.reference and adapters is None:
        ref = stage_params(dims, tp, pp, stage, layers, "reference", ep).total * num.param_bytes
    if w.critic:
        cp = stage_params(dims, tp, pp, stage, layers, "critic", ep)
        critic_shard = optimizer_shard_elements(cp, dp, ep, None)
        # moved whole: its param and grad buffers (a block each), its optimizer per tensor
        critic = block(cp.total * num.param_bytes) + block(cp.total * num.grad_bytes)
        critic += int(critic_shard * opt_state * fp32_ratio)
        critic_state = cp.total * saved
    common = {"optimizer_offload": offloaded}
    moments_pinned = int(moments_gpu * fp32_ratio)
    if opts.param_offload:
        if adapters is None:  # megatron's param buffers: dense, experts (a block each)
            buffers = block((p.total - p.experts) * num.param_bytes) + block(
                p.experts * num.param_bytes
            )
        else:  # LoRA: the frozen base tensor by tensor, the adapters' buffer
            buffers = int(p.total * num.param_bytes * param_ratio)
            buffers += block(adapters * num.param_bytes)
        rollout = {
            **common,
            "actor": buffers + int(main_gpu * fp32_ratio) + moments_pinned,
            "reference": int(ref * param_ratio),
            "critic": critic,
        }
    else:
        rollout = {**common, "adam_moments": moments_pinned}
    asleep = 0
    if w.rollout and pinned:  # vLLM's CPU build has no sleep mode
        asleep = pinned_bytes(VLLM_WORKSPACE)  # its runtime and CUDA-graph pools
        if w.sleep_level == 1:
            infer = stage_tensor_numels(dims, layout.rollout_tp, 1, 0, dims.num_layers)
            asleep += int(
                vllm_weight_bytes(dims, layout.rollout_tp) * pinned_ratio(n * 2 for n in infer)
            )
    elif w.rollout and w.sleep_level == 1:
        asleep = vllm_weight_bytes(dims, layout.rollout_tp)
    training = {**common, "vllm_asleep": asleep}
    if w.record_routes and dims.is_moe:  # the rollout's recorded experts, kept for the step;
        # the data-parallel re-deal gathers every rank's samples (and routes) on each rank
        routes = routes_bytes(dims, w, dp) * (dp if w.routes_gathered else 1)
        training["routes"] = rollout["routes"] = routes
    if w.judge is not None and pinned:  # a local judge waits in host memory (pageable)
        training["judge_asleep"] = judge_weight_bytes(w.judge)
        rollout["judge_asleep"] = judge_weight_bytes(w.judge)
    trained = adapters if adapters is not None else p.total
    staged = optimizer_staging(OPTIMIZER_SAVE, trained * saved, shard * saved, dp_rank)
    if w.critic:
        staged += optimizer_staging(OPTIMIZER_SAVE, critic_state, critic_shard * saved, dp_rank)
    written_weights = 0
    if dp_rank == 0:
        written_weights = weights
        if w.critic:
            written_weights += stage_params(dims, tp, pp, stage, layers, "critic", ep).total * (
                num.param_bytes
            )
    save = {**training, "checkpoint": staged + written_weights}
    return {"rollout": rollout, "training": training, "save": save}


def estimate_host_memory(
    dims: ModelDims,
    layout: ParallelLayout,
    workload: Workload,
    numerics: Numerics,
    options: Options,
    gpus_per_node: int,
) -> HostMemory:
    """Host bytes of every (stage, DP rank) and of every node, by phase."""
    ranks = {
        (k, d): _rank_host(dims, layout, workload, numerics, options, k, d)
        for k in range(layout.pp)
        for d in range(layout.dp)
    }
    world = layout.world_size
    per_node = max(1, min(gpus_per_node, world))
    nodes = []
    for first in range(0, world, per_node):
        totals = dict.fromkeys(HOST_PHASES, 0)
        for rank in range(first, min(world, first + per_node)):
            _, d, k = layout.coords(rank)
            for phase in HOST_PHASES:
                totals[phase] += sum(ranks[(k, d)][phase].values())
        nodes.append(totals)
    return HostMemory(ranks=ranks, nodes=nodes)
