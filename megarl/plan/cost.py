"""A simple, documented model of the time of one optimizer step of an RLHF run, for ranking layouts.

It is a ranking aid, not a benchmark: the absolute seconds are as good as the speeds in
:class:`~megarl.plan.hardware.Cluster` and the MFU guess. Terms, each in seconds:

- compute: FLOPs / (GPUs x peak x MFU). Per token, a forward pass costs 2 x (matmul params +
  seq x heads x head_dim x layers) FLOPs (causal attention), a backward twice that. One step runs
  the actor update (forward + backward, + one more forward with full recomputation, i.e. +33%),
  the actor's old log-probs and the reference's log-probs (forward each) and, for PPO, the
  critic's values and update.
  An uneven pipeline split (``parallel.pp_layers``) runs at the pace of its fullest stage.
- bubble: 1F1B with m micro-batches per DP rank idles (PP - 1) / (m + PP - 1) of the pipeline:
  compute x (PP - 1) / m.
- tp_comm: 2 all-reduces (or reduce-scatter + all-gather) of [micro-batch, seq, hidden] bf16 per
  layer per forward and 2 per backward, ring cost 2 (TP - 1) / TP x bytes / bandwidth, on the
  critical path; NVLink inside a domain, the network when TP spans more (never chosen here).
- dp_comm: reduce-scatter of the grads and all-gather of the weights once per step, over NVLink
  when the DP group stays in a node, else the network.
- pp_comm: one activation forward and one gradient backward per micro-batch and stage boundary.
- ep_comm (mixture of experts, EP > 1): each MoE layer sends every token's hidden state to its
  ``topk`` experts and back (dispatch + combine all-to-alls, bf16) per forward pass, and the
  same again backward; an all-to-all over EP ranks moves (EP - 1) / EP of those bytes, over
  NVLink while the TP x EP group stays in a node, else the network.
- offload: optimizer offload moves grads to host and weights back over the host link and runs
  Adam on the CPU (16 bytes of state per param read and written at ~20 GB/s per GPU's share);
  param offload moves actor and reference weights out and back once per step.
- rollout: vLLM generation of the step's sequences: memory-bound decoding (each step reads the
  engine's weight shard and the KV cache from HBM, plus 2 all-reduce latencies per layer with
  infer_tp > 1), after a compute-bound prefill of the prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.plan.hardware import Cluster
from megarl.plan.memory import Numerics, Options
from megarl.plan.params import flops_params, stage_params
from megarl.plan.workload import Workload

CPU_ADAM_GBPS = 20.0
ALLREDUCE_LATENCY_S = 10e-6


@dataclass(frozen=True)
class StepTime:
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def _ring(bytes_: float, n: int, gbps: float, factor: float = 2.0) -> float:
    """Ring collective over n ranks moving ``factor * (n-1)/n * bytes``."""
    if n <= 1:
        return 0.0
    return factor * (n - 1) / n * bytes_ / (gbps * 1e9)


def step_time(
    dims: ModelDims,
    layout: ParallelLayout,
    workload: Workload,
    options: Options,
    cluster: Cluster,
    numerics: Numerics,
    kv_tokens: int | None = None,
) -> StepTime:
    """Predicted seconds of one optimizer step, by term (``kv_tokens``: the KV cache's capacity
    in vLLM's fraction mode, which caps how many sequences decode at once)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    n_gpus = layout.world_size
    s, b = workload.tokens_per_sequence(options.packing), workload.micro_batch
    tokens = workload.global_batch * s
    m = workload.micro_batches(dp)
    q = dims.num_attention_heads * dims.head_dim
    per_pass = 2 * (flops_params(dims) + s * q * dims.num_layers)  # forward FLOPs per token
    # forward + backward (+ a second forward under full recompute), in passes; selective
    # recompute re-runs only the core attention, left out of these per-token FLOPs
    update = 3 + (1 if options.recompute == "full" else 0)
    passes = update + 1 + (1 if workload.reference else 0)
    if workload.critic:
        passes += update + 1
    flops = passes * per_pass * tokens
    # An uneven pipeline split runs at the pace of its fullest stage.
    stages = layout.layers_per_stage(dims.num_layers)
    imbalance = max(stages) * pp / dims.num_layers
    compute = imbalance * flops / (n_gpus * cluster.peak_tflops * 1e12 * cluster.mfu)
    train_compute = update * per_pass * tokens / (n_gpus * cluster.peak_tflops * 1e12 * cluster.mfu)
    bubble = train_compute * (pp - 1) / m * (2 if workload.critic else 1)

    # TP: 2 collectives per layer per forward pass, 2 per backward pass.
    collectives = 2 * (update + 1) + 2 * (1 if workload.reference else 0)
    if workload.critic:
        collectives += 2 * (update + 1)
    act_bytes = b * s * dims.hidden_size * 2
    layers_per_rank = max(stages)
    tp_comm = collectives * layers_per_rank * m * _ring(act_bytes, tp, cluster.link_gbps(tp), 2.0)

    ep_comm = 0.0
    if dims.is_moe and layout.ep > 1:
        ep = layout.ep
        a2a_bytes = b * s * dims.moe_topk * dims.hidden_size * 2 / tp
        a2a = 2 * (ep - 1) / ep * a2a_bytes / (cluster.link_gbps(tp * ep) * 1e9)
        ep_comm = collectives * layers_per_rank * m * a2a
    p_rank = max(
        stage_params(dims, tp, pp, k, n, "actor", layout.ep).total
        for k, n in enumerate(layout.layers_per_stage(dims.num_layers))
    )
    dp_bytes = p_rank * (numerics.grad_bytes + numerics.param_bytes)
    dp_comm = _ring(dp_bytes, dp, cluster.link_gbps(tp * dp), 1.0) * (2 if workload.critic else 1)

    pp_comm = 0.0
    if pp > 1:
        boundary_gbps = cluster.link_gbps(2 * tp * dp)
        pp_comm = (m + pp - 2) * 2 * act_bytes / tp / (boundary_gbps * 1e9) * (update / 3)

    offload = 0.0
    shard = p_rank / dp
    if options.optimizer_offload:
        moved = shard * (numerics.grad_bytes + numerics.param_bytes)
        offload += moved / (cluster.host_gbps * 1e9) + shard * 16 * 2 / (CPU_ADAM_GBPS * 1e9)
    if options.param_offload:
        weights = p_rank * numerics.param_bytes * (2 if workload.reference else 1)
        offload += 2 * weights / (cluster.host_gbps * 1e9)

    rollout = _rollout_time(dims, layout, workload, cluster, kv_tokens) if workload.rollout else 0.0
    return StepTime(
        parts={
            "compute": compute,
            "bubble": bubble,
            "tp_comm": tp_comm,
            "dp_comm": dp_comm,
            "pp_comm": pp_comm,
            "ep_comm": ep_comm,
            "offload": offload,
            "rollout": rollout,
        }
    )


def rollout_time(
    dims: ModelDims,
    layout: ParallelLayout,
    workload: Workload,
    cluster: Cluster,
    kv_tokens: int | None = None,
) -> float:
    """Predicted seconds of the step's generation on ``layout``'s vLLM engines."""
    return _rollout_time(dims, layout, workload, cluster, kv_tokens)


def _rollout_time(
    dims: ModelDims,
    layout: ParallelLayout,
    workload: Workload,
    cluster: Cluster,
    kv_tokens: int | None,
) -> float:
    itp = layout.rollout_tp
    engines = layout.world_size // itp
    seqs = math.ceil(workload.global_batch / engines)
    concurrency = min(seqs, workload.rollout_seqs)
    if kv_tokens is not None:
        concurrency = max(1, min(concurrency, kv_tokens // workload.seq_len))
    response = workload.response_tokens
    prompt = workload.seq_len - response
    weights = stage_params(dims, itp, 1, 0, dims.num_layers).total * 2
    kv_per_token = 2 * dims.num_layers * max(1, dims.num_kv_heads // itp) * dims.head_dim * 2
    avg_ctx = prompt + response / 2
    step_bytes = weights + concurrency * avg_ctx * kv_per_token
    per_step = step_bytes / (cluster.hbm_gbps * 1e9)
    if itp > 1:
        per_step += 2 * dims.num_layers * ALLREDUCE_LATENCY_S
    decode = math.ceil(seqs / concurrency) * response * per_step
    prefill_flops = 2 * flops_params(dims) * seqs * prompt
    prefill = prefill_flops / (itp * cluster.peak_tflops * 1e12 * cluster.mfu)
    return decode + prefill
