"""Memory one GPU (one rank) needs for one layout, phase by phase.

What a rank holds, for its pipeline stage (P = that stage's parameters on this TP rank):

- weights: P x param bytes (megatron DDP keeps them in one contiguous param buffer);
- grads: P x grad bytes (DDP grad buffer, fp32 by default: ``grad_reduce_in_fp32``);
- optimizer: P / DP x (main-param bytes + 8): the distributed optimizer shards Adam's m and v
  (fp32) and, for 16-bit params, an fp32 master copy over data-parallel ranks. Optimizer offload
  (``actor.optimizer_offload``, the actor's only) moves its share of both to the host: megarl
  turns on megatron's precision-aware optimizer with it, without which megatron keeps the master
  copy on the GPU (:attr:`Numerics.offload_main_params`);
- activations: micro-batches in flight x stored bytes per micro-batch (see
  :mod:`megarl.plan.activations`; with packing, of the micro-batch's real tokens: micro-batch x
  the workload's mean sequence length); 1F1B keeps ``min(PP - stage, micro-batches)`` in flight, so
  stage 0 holds PP of them; plus the loss's vocabulary tensors on the last stage, the
  temporaries of the backward pass (below) and, for a mixture of experts, one layer's token
  dispatch (the routed copies, the expert-parallel all-to-all's and the expert-TP all-gather's
  outputs);
- reference: its weights only (forward only, frozen);
- critic (PPO): weights + grads + optimizer like the actor (never offloaded), with a value head;
- rollout: vLLM's weights at ``infer_tp`` in bf16, its KV cache and a workspace;
- reserve: the CUDA context, the NCCL communicators of the layout and a fragmentation margin
  (:mod:`megarl.plan.reserve`).

The colocated hybrid engine never trains and generates at once, so the peak is the largest of
the phases, each being what stays resident plus what that phase adds:

- resident in every phase: actor weights, actor fp32 master params (unless optimizer offload),
  reference weights, the critic's weights, grads and optimizer state (megarl frees only the
  actor's), and the reserve;
- setup: megatron's DDP wrap copies the weights into its param buffer while the module's own
  tensors are alive (one extra weights copy), before any optimizer state exists; later the
  reference is built and the critic wrapped the same way (PPO);
- forward-backward: + actor grads, Adam m and v, activations and transients (steady state: the
  optimizer state exists from the first step on);
- grad sync (gloo only): + a copy of the largest DDP bucket (gloo's coalesced reduce-scatter);
- optimizer step: + Adam's per-tensor temporaries (torch's Adam: two of the largest shard;
  fused multi-tensor Adam on GPUs: none);
- start-up (vLLM's fraction mode, ``gpu_memory_utilization``): vLLM is built after the models, and
  it refuses to start unless ``gpu_memory_utilization`` x the GPU's memory is still free: what is
  resident then (weights, the DDP grad buffers, fp32 master params; Adam's m and v are made at
  the first step) plus that whole budget;
- rollout: the actor's grad buffer is freed and Adam's m and v go to host memory (what megarl's
  hybrid engine does on GPUs); + vLLM weights, KV cache and workspace, or, while the reshard runs
  (vLLM's KV cache still asleep), vLLM's weights and workspace and two reshard buckets
  (:func:`reshard_buffer_bytes`), whichever is more. With param offload the actor, reference and
  critic weights leave the GPU after the weights are handed to vLLM;
- scoring: after vLLM sleeps, the trainer scores the rollout (old and reference logprobs, critic
  values) forward only, in the update's micro-batches; + one micro-batch's forward working set
  (one layer's tensors and an MoE layer's dispatch, or at the output layer its logits, their
  temperature-scaled copy and the log-prob's two fp32 chunks) and the scores kept for the whole
  rollout batch. A reward model scores ``micro_batch`` whole sequences per forward (its working
  set: one layer's tensors).

A reward model (``reward.model_path``) is resident in every phase (frozen, weights only).

The backward temporaries: at the loss, the logits and the loss's vocabulary work buffers
(megarl's vocab-parallel log-prob: logits, their gradient, two fp32 chunks of at most 2^25
elements); without fused weight-gradient accumulation, each weight's gradient exists once
before it is added to the grad buffer, the largest being the output layer's (V/TP x h); a tied
embedding at PP = 1 accumulates its two gradients (3 vocabulary-sized tensors at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.plan.activations import (
    CPU_LOCAL_FP32,
    GPU_TE_BF16,
    ActivationProfile,
    checkpoint_bytes,
    hidden_bytes,
    layer_bytes,
    moe_dispatch_bytes,
)
from megarl.plan.lora import lora_layer_params
from megarl.plan.params import StageParams, layer_params, stage_params
from megarl.plan.reserve import Reserve, fixed_reserve, layout_reserve
from megarl.plan.units import GIB
from megarl.plan.workload import Workload
from megarl.weights.reshard_mode import resolve_reshard_mode

LOSS_CHUNK_ELEMS = 1 << 25  # megarl.algos.vocab_parallel.DEFAULT_CHUNK_ELEMS
VLLM_WORKSPACE = 1 * GIB  # CUDA graphs, activation workspace, allocator slack (an estimate)
RESHARD_BUCKET = 256 << 20  # megarl.rollout.engine.HybridEngine's bucket_bytes
ROLLOUT_WEIGHT_BYTES = 2  # vLLM's weights, bf16


@dataclass(frozen=True)
class Numerics:
    """Bytes per parameter of what training keeps, and which runtime paths are fused."""

    name: str
    param_bytes: int
    grad_bytes: int
    main_param_bytes: int  # fp32 master copy in the distributed optimizer (0: params are fp32)
    activations: ActivationProfile
    fused_wgrad: bool  # weight grads accumulate straight into the grad buffer (TE)
    fused_adam: bool  # multi-tensor Adam without temporaries (TE / apex)
    gloo: bool  # gloo's coalesced reduce-scatter copies each DDP bucket
    adam_bytes: int = 8  # m and v, fp32
    # Optimizer offload moves the fp32 main params with Adam's moments: megarl turns on
    # megatron's precision-aware optimizer with the offload (it needs Transformer Engine). Without
    # it megatron keeps the main params on the GPU (measured on an H200: 8.07 bytes freed per
    # parameter, not 12).
    offload_main_params: bool = True

    @property
    def logits_bytes(self) -> int:
        return self.param_bytes  # the output layer computes in the model dtype


GPU_BF16 = Numerics(
    name="gpu-bf16",
    param_bytes=2,
    grad_bytes=4,
    main_param_bytes=4,
    activations=GPU_TE_BF16,
    fused_wgrad=True,
    fused_adam=True,
    gloo=False,
)

# What megarl runs on CPU (tests, quickstart): fp32 weights, megatron local spec, torch Adam, gloo.
CPU_FP32 = Numerics(
    name="cpu-fp32",
    param_bytes=4,
    grad_bytes=4,
    main_param_bytes=0,
    activations=CPU_LOCAL_FP32,
    fused_wgrad=False,
    fused_adam=False,
    gloo=True,
)


@dataclass(frozen=True)
class Options:
    """Knobs of one candidate beyond its layout."""

    recompute: str = "none"  # none | selective | full, as config's model.recompute
    # as config's parallel.sequence_parallel: None is on when tp > 1 (splits the hidden-size
    # activations along the sequence over the TP group)
    sequence_parallel: bool | None = None
    # the search tries off and on; preflight passes the config's share offloaded (0..1)
    optimizer_offload: bool | float = False
    param_offload: bool = False
    # as config's actor.packing: a micro-batch is one pack of its sequences' real tokens, so
    # activations scale with the workload's mean sequence length (the loss's outputs keep the
    # padded batch's shape)
    packing: bool = True


ITEMS = (
    "weights",
    "grads",
    "optimizer",
    "activations",
    "transient",
    "reference",
    "critic",
    "reward_model",
    "scores",
    "judge",
    "rollout",
    "reserve",
)
# The item each phase adds to what stays resident: what overflows when the phase does not fit.
PHASE_ITEMS = {
    "setup": "transient",
    "forward-backward": "activations",
    "grad-sync": "transient",
    "optimizer-step": "transient",
    "startup": "rollout",
    "rollout": "rollout",
    "scoring": "activations",
    "judging": "judge",
}


@dataclass
class StageMemory:
    """Peak bytes of one rank of one pipeline stage, by phase, and the peak phase's items."""

    stage: int
    phases: dict[str, int]
    items: dict[str, int]  # composition of the peak phase
    phase_items: dict[str, dict[str, int]] = field(default_factory=dict)
    kv_capacity_tokens: int | None = None  # vLLM fraction mode: tokens its KV cache holds

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    @property
    def largest_item(self) -> tuple[str, int]:
        name = max(self.items, key=self.items.__getitem__)
        return name, self.items[name]


@dataclass
class MemoryEstimate:
    """Every stage's memory; the layout's peak is the worst stage."""

    stages: list[StageMemory]
    rollout_kv_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    reserve: Reserve = field(default_factory=lambda: fixed_reserve(0))

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.peak)

    @property
    def peak(self) -> int:
        return self.worst.peak


def _loss_bytes(rows: int, vocab_shard: int, logits_bytes: int) -> tuple[int, int]:
    """(peak of megarl's vocab-parallel log-prob at the loss, one logits tensor)."""
    logits = rows * vocab_shard * logits_bytes
    chunk_rows = min(rows, max(1, LOSS_CHUNK_ELEMS // max(vocab_shard, 1)))
    return 2 * logits + 2 * chunk_rows * vocab_shard * 4, logits


def _model_static(
    p: StageParams,
    num: Numerics,
    dp: int,
    offload: float,
    ep: int = 1,
    adapters: int | None = None,
) -> dict[str, int]:
    """Weights, grads and optimizer state of a stage; with LoRA ``adapters`` (their elements)
    only those have grads and optimizer state, beside the frozen weights. The distributed
    optimizer shards dense weights over DP, MoE experts over expert DP (dp/ep). ``offload``: the
    share of the optimizer state (fp32 master params, m and v) held on the host."""
    if adapters is None:
        dense, experts = p.total - p.experts, p.experts
    else:
        dense, experts = adapters, 0
    expert_dp = max(1, dp // ep)

    def shard(per_param: int) -> int:
        return -(-dense * per_param // dp) + -(-experts * per_param // expert_dp)

    on_gpu = 1.0 - float(offload)
    main_on_gpu = on_gpu if num.offload_main_params else 1.0
    return {
        "weights": (p.total + (adapters or 0)) * num.param_bytes,
        "grads": (dense + experts) * num.grad_bytes,
        "main": int(main_on_gpu * shard(num.main_param_bytes)),
        "moments": int(on_gpu * shard(num.adam_bytes)),
    }


def offload_freed_bytes_per_param(num: Numerics) -> int:
    """Device bytes per parameter (of the offloaded share) that optimizer offload frees."""
    return num.adam_bytes + (num.main_param_bytes if num.offload_main_params else 0)


def optimizer_shard_elements(p: StageParams, dp: int, ep: int, adapters: int | None) -> int:
    """Parameters whose optimizer state one rank holds (its distributed-optimizer shard)."""
    if adapters is not None:
        return -(-adapters // dp)
    expert_dp = max(1, dp // ep)
    return -(-(p.total - p.experts) // dp) + -(-p.experts // expert_dp)


def _largest_bucket(p: StageParams, grad_bytes: int) -> int:
    if p.shared_vocab_bucket:
        return max(p.vocab, p.total - p.vocab) * grad_bytes
    return p.total * grad_bytes


def vllm_weight_bytes(dims: ModelDims, infer_tp: int) -> int:
    """vLLM's bf16 weights per rank at ``infer_tp``."""
    return stage_params(dims, infer_tp, 1, 0, dims.num_layers).total * ROLLOUT_WEIGHT_BYTES


def judge_weight_bytes(judge: ModelDims) -> int:
    """A local judge's replica (megarl.rollout.judge_engine), bf16."""
    return stage_params(judge, 1, 1, 0, judge.num_layers).total * ROLLOUT_WEIGHT_BYTES


def judge_bytes(w: Workload) -> int:
    """A local judge while it answers: its weights, the keys and values of one sequence of
    ``judge_len`` tokens (it generates one request at a time) and one step's fp32 logits (the
    sampler's and the ones it keeps per answer token); 0 without a judge."""
    if w.judge is None:
        return 0
    logits = 2 * w.judge.vocab_size * 4
    return judge_weight_bytes(w.judge) + kv_bytes_per_token(w.judge, 1) * w.judge_len + logits


def routes_bytes(dims: ModelDims, w: Workload, dp: int) -> int:
    """The recorded experts of one rank's rollout (int16 per token, MoE layer and top-k slot,
    padded to the longest sequence): 0 without recording or for a dense model."""
    if not (w.record_routes and dims.is_moe):
        return 0
    sequences = -(-(w.rollout_batch or w.global_batch) // dp)
    return sequences * w.seq_len * dims.num_layers * dims.moe_topk * 2


def reshard_buffer_bytes(
    dims: ModelDims, infer_tp: int, bucket_bytes: int = RESHARD_BUCKET, backend: str = "vllm"
) -> int:
    """What the reshard assembles on a rank at once, bf16: two buckets (one loads while the
    next travels); a bucket holds whole groups up to ``bucket_bytes``, and a group larger than
    that alone: a whole layer (megarl.weights.tensor_list.update_group) or a vocabulary
    tensor. In ``full`` mode (vLLM with an MoE model) every rank assembles whole tensors; in
    ``shard`` mode only its rollout TP rank's slices."""
    mode = resolve_reshard_mode("auto", backend, dims.is_moe)
    cut = infer_tp if mode == "shard" else 1
    split, replicated, _ = layer_params(dims, cut)
    layer = split + replicated
    vocab = dims.vocab_size * dims.hidden_size // cut
    largest = max(layer, vocab) * ROLLOUT_WEIGHT_BYTES
    model = stage_params(dims, cut, 1, 0, dims.num_layers).total * ROLLOUT_WEIGHT_BYTES
    return 2 * max(largest, min(bucket_bytes, model))


def kv_bytes_per_token(dims: ModelDims, infer_tp: int) -> int:
    """Keys and values of one token in every layer, per rank, bf16."""
    return 2 * dims.num_layers * max(1, dims.num_kv_heads // infer_tp) * dims.head_dim * 2


def vllm_workspace_bytes(dims: ModelDims, rollout_seqs: int) -> int:
    """vLLM's activations, CUDA graphs and sampler (fp32 logits of the scheduled sequences)."""
    return VLLM_WORKSPACE + 2 * rollout_seqs * dims.vocab_size * 4


def _rollout_bytes(
    dims: ModelDims, infer_tp: int, w: Workload, gpu_memory: int
) -> tuple[int, int, int, int | None]:
    """(vLLM weights, KV cache, workspace, KV capacity in tokens or None) per rank, bf16."""
    weights = vllm_weight_bytes(dims, infer_tp)
    kv_per_token = kv_bytes_per_token(dims, infer_tp)
    workspace = vllm_workspace_bytes(dims, w.rollout_seqs)
    if w.gpu_memory_utilization is None:
        return weights, w.rollout_seqs * w.seq_len * kv_per_token, workspace, None
    budget = int(w.gpu_memory_utilization * gpu_memory)
    kv = max(0, budget - weights - workspace)
    return weights, kv, workspace, kv // kv_per_token


def estimate_memory(
    dims: ModelDims,
    layout: ParallelLayout,
    workload: Workload,
    numerics: Numerics = GPU_BF16,
    options: Options = Options(),
    gpu_memory: int = 80 * GIB,
    reserve: int | None = None,
) -> MemoryEstimate:
    """Per-stage, per-phase peak memory of one rank (see the module doc for what is counted);
    ``reserve``: bytes per GPU outside the items, None: computed from the layout
    (:func:`megarl.plan.reserve.layout_reserve`)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    kept = (
        layout_reserve(layout, gpu_memory, dims.is_moe, dims.tie_word_embeddings, workload.rollout)
        if reserve is None
        else fixed_reserve(reserve)
    )
    # SP needs TP: "on" at tp 1 is what the engine does with the setting unset there (nothing)
    sp = (options.sequence_parallel is not False) and tp > 1
    act = replace(numerics.activations, sequence_parallel=sp)
    b, s_act = workload.micro_batch_shape(options.packing)  # what the layers see per micro-batch
    m = workload.micro_batches(dp)
    pb = numerics.param_bytes
    layers = layout.layers_per_stage(dims.num_layers)
    rollout = (
        _rollout_bytes(dims, layout.rollout_tp, workload, gpu_memory)
        if workload.rollout
        else (0, 0, 0, None)
    )
    vllm_weights, kv, workspace, kv_tokens = rollout
    per_layer = layer_bytes(act, dims, tp, b, s_act)
    stored_layer = {
        "none": per_layer,
        "selective": layer_bytes(act, dims, tp, b, s_act, scores=False),
        "full": checkpoint_bytes(act, dims, tp, b, s_act),
    }[options.recompute]
    hid = hidden_bytes(act, dims, tp, b, s_act)
    dispatch = moe_dispatch_bytes(act, dims, tp, b, s_act)  # while an MoE layer dispatches
    _, _, largest_layer_weight = layer_params(dims, tp, layout.ep)
    stages = []
    for k in range(pp):
        first, last = k == 0, k == pp - 1
        actor_p = stage_params(dims, tp, pp, k, layers[k], "actor", layout.ep)
        lora = layers[k] * lora_layer_params(dims, tp, workload.lora_rank) or None
        actor = _model_static(actor_p, numerics, dp, options.optimizer_offload, layout.ep, lora)
        ref = (
            stage_params(dims, tp, pp, k, layers[k], "reference", layout.ep).total * pb
            if workload.reference and lora is None  # a LoRA actor's base is its reference
            else 0
        )
        critic_total = 0
        critic_wrap = 0
        critic_startup = 0
        if workload.critic:
            critic_p = stage_params(dims, tp, pp, k, layers[k], "critic", layout.ep)
            # built without optimizer offload (megarl.trainer.roles: only the actor's offloads)
            c = _model_static(critic_p, numerics, dp, 0.0, layout.ep)
            critic_total = sum(c.values())
            critic_wrap = c["weights"] + c["grads"] + c["weights"]  # module + param buffer + grads
            # once wrapped: weights, grads and the fp32 master params (m and v come at step 1)
            critic_startup = c["weights"] + c["grads"] + c["main"]

        # Activations of one micro-batch on this stage, and how many are in flight (1F1B).
        one_mb = layers[k] * stored_layer + int(act.stage_input * hid)
        if last:
            one_mb += int(act.final_hidden * hid)
        in_flight = min(pp - k, m)
        # The backward re-runs one layer's forward (full) or its core attention (selective).
        recompute_extra = 0
        if layers[k] and options.recompute == "full":
            recompute_extra = per_layer
        elif layers[k] and options.recompute == "selective":
            recompute_extra = per_layer - stored_layer
        held = in_flight * one_mb + recompute_extra
        vocab_shard = dims.vocab_size // tp
        vocab_weight = vocab_shard * dims.hidden_size * pb  # one embedding/output-layer shard
        rows = workload.logits_rows()
        candidates = [held]  # at the loss (non-last stages: the newest micro-batch's forward end)
        if dispatch and layers[k]:
            candidates.append(held + dispatch)  # inside an MoE layer (forward or backward)
        if not numerics.fused_wgrad and layers[k]:
            candidates.append(held + largest_layer_weight * pb)
        if last and actor_p.vocab:
            loss_peak, logits = _loss_bytes(rows, vocab_shard, numerics.logits_bytes)
            candidates.append(held + loss_peak)
            if not numerics.fused_wgrad:
                candidates.append(held + 2 * logits + vocab_weight)  # output-layer weight grad
        if first:
            emb_grads = 3 if actor_p.tied_single and not numerics.fused_wgrad else 1
            candidates.append((in_flight - 1) * one_mb + emb_grads * vocab_weight)
        activations = max(candidates)

        res = kept.total
        opt_gpu = actor["main"] + actor["moments"]
        rm = 0
        rm_layers = 0
        if workload.reward_model is not None:
            rm_dims = workload.reward_model
            rm_layers = ParallelLayout(tp=tp, pp=pp).layers_per_stage(rm_dims.num_layers)[k]
            rm = stage_params(rm_dims, tp, pp, k, rm_layers, "critic").total * pb
        common = {
            "weights": actor["weights"],
            "reference": ref,
            "critic": critic_total,
            "reward_model": rm,
        }
        train_base = {**common, "grads": actor["grads"], "optimizer": opt_gpu, "reserve": res}
        phase_items: dict[str, dict[str, int]] = {}
        # Setup: the actor's DDP wrap (its param-buffer copy while the module's own tensors
        # live), or later what megarl builds after it (megarl.trainer.roles: actor, reference,
        # critic): fp32 master params, the reference, the critic's own wrap.
        wrap = {"weights": actor["weights"], "grads": actor["grads"], "reserve": res}
        trained_weights = (lora or actor_p.total) * pb  # what DDP's param buffer copies
        phase_items["setup"] = max(
            (
                {**wrap, "transient": trained_weights},
                {
                    **wrap,
                    "optimizer": actor["main"],
                    "reference": ref,
                    "critic": critic_wrap,
                    "reward_model": rm,
                },
            ),
            key=lambda d: sum(d.values()),
        )
        phase_items["forward-backward"] = {**train_base, "activations": activations}
        if numerics.gloo:
            bucket = _largest_bucket(actor_p, numerics.grad_bytes) if lora is None else 0
            bucket = bucket or (lora or 0) * numerics.grad_bytes
            phase_items["grad-sync"] = {**train_base, "transient": bucket}
        if not numerics.fused_adam and not options.optimizer_offload:
            shard = min(actor_p.largest, -(-(lora or actor_p.total) // dp))
            phase_items["optimizer-step"] = {**train_base, "transient": 2 * shard * 4}
        if workload.scoring:
            scoring = _scoring_bytes(act, dims, workload, numerics, tp, b, s_act, layers[k], last)
            if workload.reward_model is not None:
                # megarl.rewards.model.score_sequences: micro_batch sequences, whatever the budget
                rm_rows, rm_seq = workload.micro_batch, workload.seq_len
                rm_ws = 2 * hidden_bytes(act, workload.reward_model, tp, rm_rows, rm_seq)
                if rm_layers:
                    rm_ws += layer_bytes(act, workload.reward_model, tp, rm_rows, rm_seq)
                scoring = max(scoring, rm_ws)
            phase_items["scoring"] = {
                **train_base,
                "activations": scoring,
                "scores": _scores_bytes(workload, dp),
            }
        if workload.judge is not None:  # it answers between the rollout and the scoring pass
            phase_items["judging"] = {**train_base, "judge": judge_bytes(workload)}
        if workload.rollout:
            # vLLM starts (with its whole budget, in fraction mode) beside what the models hold
            phase_items["startup"] = {
                "weights": actor["weights"],
                "grads": actor["grads"],
                "optimizer": actor["main"],
                "reference": ref,
                "critic": critic_startup,
                "reward_model": rm,
                "rollout": vllm_weights + kv + workspace,
                "reserve": res,
            }
        if workload.rollout:
            vllm = vllm_weights + kv + workspace
            if options.param_offload:
                # Weights leave the GPU once vLLM has its copy; the reshard moment holds both,
                # and the buckets in flight.
                reshard = {
                    "weights": actor["weights"],
                    "rollout": vllm_weights,
                    "transient": reshard_buffer_bytes(dims, layout.rollout_tp),
                }
                generate = {"rollout": vllm}
                moment = max((reshard, generate), key=lambda d: sum(d.values()))
                rollout_items = {**moment, "optimizer": actor["main"], "reward_model": rm}
                rollout_items["reserve"] = res
            else:
                rollout_items = {**common, "optimizer": actor["main"], "rollout": vllm}
                rollout_items["reserve"] = res
                # The reshard runs with vLLM's weights awake and its KV cache not yet: the models,
                # vLLM's weights and workspace, and the buckets in flight.
                buckets = reshard_buffer_bytes(dims, layout.rollout_tp)
                resharding = {
                    **common,
                    "optimizer": actor["main"],
                    "rollout": vllm_weights + workspace,
                    "transient": buckets,
                    "reserve": res,
                }
                if sum(resharding.values()) > sum(rollout_items.values()):
                    rollout_items = resharding
            phase_items["rollout"] = rollout_items
        phases = {name: sum(items.values()) for name, items in phase_items.items()}
        peak_phase = max(phases, key=phases.__getitem__)
        items = {name: phase_items[peak_phase].get(name, 0) for name in ITEMS}
        stages.append(
            StageMemory(
                stage=k,
                phases=phases,
                items=items,
                phase_items=phase_items,
                kv_capacity_tokens=kv_tokens,
            )
        )
    return MemoryEstimate(stages=stages, rollout_kv_bytes=kv, reserve=kept)


def _scoring_bytes(
    act: ActivationProfile,
    dims: ModelDims,
    w: Workload,
    numerics: Numerics,
    tp: int,
    rows: int,
    tokens: int,
    layers: int,
    last: bool,
) -> int:
    """One scoring micro-batch's forward working set on a stage (no grad: nothing is stored for a
    backward). Bounded by the tensors of one layer live at once (what that layer would store for
    the backward, and an MoE layer's token dispatch) or, at the output layer, the logits of the projected positions, their
    temperature-scaled copy, the log-prob's two fp32 chunks and its fp32 result; plus the hidden
    states entering and leaving the stage."""
    hidden = 2 * hidden_bytes(act, dims, tp, rows, tokens)
    layer = 0
    if layers:  # an MoE layer's token dispatch comes on top of its tensors
        layer = layer_bytes(act, dims, tp, rows, tokens) + moe_dispatch_bytes(
            act, dims, tp, rows, tokens
        )
    loss = 0
    if last:
        n_rows = w.logits_rows()
        vocab_shard = dims.vocab_size // tp
        logits = n_rows * vocab_shard * numerics.logits_bytes
        chunk_rows = min(n_rows, max(1, LOSS_CHUNK_ELEMS // max(vocab_shard, 1)))
        copies = 2 if w.temperature not in (0.0, 1.0) else 1
        loss = copies * logits + 2 * chunk_rows * vocab_shard * 4 + n_rows * 4
    return hidden + max(layer, loss)


def _scores_bytes(w: Workload, dp: int) -> int:
    """The rollout batch's per-token scores one rank keeps (fp32, response space): vLLM's and the
    actor's logprobs, the reference's, the critic's values."""
    tensors = 2 + (1 if w.reference else 0) + (1 if w.critic else 0)
    seqs = -(-w.rollout_sequences // dp)
    return tensors * seqs * w.response_tokens * 4


def with_grad_bytes(numerics: Numerics, grad_bytes: int) -> Numerics:
    return replace(numerics, grad_bytes=grad_bytes)
