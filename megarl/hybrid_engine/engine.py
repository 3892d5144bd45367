"""The 3D-HybridEngine: the actor trains in megatron's TP x PP x DP layout and rolls out in vLLM's.

The trainer's loop reads as two transitions around generation::

    engine.to_rollout()                  # free grads (and offload optimizer state on GPUs),
                                         # reshard weights bucket by bucket into vLLM, wake vLLM
    batch = engine.generate(prompts, sampling)
    engine.to_train()                    # vLLM sleeps, training memory comes back

Resharding follows a pure plan (:mod:`megarl.hybrid_engine.reshard_plan`) computed identically on every
rank; the executor (:mod:`megarl.hybrid_engine.execute`) moves each bucket and hands it to vLLM in
Hugging Face layout, cast to the rollout's dtype (``rollout.dtype``). Rollout prompts: each
training DP rank passes its own prompts; they are spread over the ``world / infer_tp`` vLLM engines
and every rank gets back the responses of its DP rank, scored by the actor (teacher-forced
logprobs: the old logprobs, and the rollout-trainer mismatch) unless the trainer takes both from its
update's forward (:mod:`megarl.trainer.old_log_probs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from megarl import parallel, platform
from megarl.hybrid_engine.execute import (
    ReshardExecutor,
    ReshardStats,
    hf_output_shapes,
    local_spec_tensors,
)
from megarl.hybrid_engine.lora_merge import merged_local_tensors
from megarl.hybrid_engine.mismatch import (  # the reductions: re-exported for existing importers
    LOGPROB_MISMATCH_REDUCTIONS as LOGPROB_MISMATCH_REDUCTIONS,
)
from megarl.hybrid_engine.mismatch import logprob_mismatch
from megarl.hybrid_engine.reshard_plan import plan_reshard
from megarl.hybrid_engine.tensor_list import actor_tensor_specs
from megarl.hybrid_engine.vllm_rollout import (
    EngineConfig,
    RolloutOutput,
    SamplingConfig,
    VLLMRollout,
    checkpoint_shapes,
)
from megarl.models.dims import ModelDims
from megarl.models.lora import has_lora
from megarl.parallel import ParallelLayout

ROLLOUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class RolloutBatch:
    """This DP rank's prompts and responses (sample j of prompt i at ``i * n + j``)."""

    prompts: list[list[int]]
    output: RolloutOutput
    # [samples, max_len - 1] teacher-forced actor logprobs of sequence tokens 1.. (prompt+response,
    # right padded); the response part starts at len(prompt) - 1.
    actor_logprobs: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    score_seconds: float = 0.0  # the actor's scoring forward (0: not scored)

    def sequences(self) -> list[list[int]]:
        return [
            list(self.prompts[i]) + list(r)
            for i, r in zip(self.output.prompt_index, self.output.token_ids, strict=True)
        ]

    def response_actor_logprobs(self) -> list[torch.Tensor]:
        """Per sample, the actor's logprob of each response token."""
        assert self.actor_logprobs is not None
        out = []
        for row, (i, r) in enumerate(
            zip(self.output.prompt_index, self.output.token_ids, strict=True)
        ):
            start = len(self.prompts[i]) - 1
            out.append(self.actor_logprobs[row, start : start + len(r)])
        return out


def check_rollout_model(
    produced: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], tied: bool
) -> None:
    """The reshard output must be exactly the rollout model's tensors (names and shapes)."""
    for name, shape in produced.items():
        if name not in expected:
            raise ValueError(
                f"reshard plan produces {name!r}, which the rollout model does not have"
            )
        if tuple(expected[name]) != tuple(shape):
            raise ValueError(
                f"reshard plan produces {name!r} with shape {list(shape)} but the rollout model "
                f"expects {list(expected[name])}"
            )
    missing = [n for n in expected if n not in produced and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"reshard plan does not produce the rollout model's tensor {missing[0]!r}")


class RolloutEngine(Protocol):
    """The seam between the trainer and a rollout backend (vLLM, or transformers' generate)."""

    infer_tp: int

    def validate(self, weights: Sequence[tuple[str, torch.Tensor | tuple[int, ...]]]) -> None: ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def after_weight_update(self) -> None: ...

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, seed_offset: int
    ) -> RolloutOutput: ...

    def sleep(self) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...


def _vllm_rollout(*args) -> RolloutEngine:
    return VLLMRollout(*args)


def _hf_rollout(*args) -> RolloutEngine:
    from megarl.hybrid_engine.hf_rollout import HFRollout

    return HFRollout(*args)


# rollout.backend -> engine constructor (model_dir, infer_tp, EngineConfig, expected shapes)
ROLLOUT_BACKENDS: dict[str, Callable[..., RolloutEngine]] = {
    "vllm": _vllm_rollout,
    "hf": _hf_rollout,
}


def make_rollout(
    backend: str,
    model_dir: str | Path,
    infer_tp: int,
    config: EngineConfig | None,
    expected_shapes: dict[str, tuple[int, ...]],
) -> RolloutEngine:
    """The rollout engine ``rollout.backend`` names, over this rank's inference-TP group."""
    from megarl.backends import check_rollout_backend

    check_rollout_backend(backend)
    return ROLLOUT_BACKENDS[backend](model_dir, infer_tp, config, expected_shapes)


def gpu_memory_metrics(moment: str) -> dict[str, float]:
    """GPU memory of this process at ``moment`` (GiB): torch's allocated and reserved, and the
    whole device's use (vLLM's sleep-mode pool is outside torch's allocator). Empty on CPU."""
    if not torch.cuda.is_available():
        return {}
    device = platform.device()
    free, total = torch.cuda.mem_get_info(device)
    gib = float(1 << 30)
    return {
        f"memory/allocated_gib_{moment}": torch.cuda.memory_allocated(device) / gib,
        f"memory/reserved_gib_{moment}": torch.cuda.memory_reserved(device) / gib,
        f"memory/device_used_gib_{moment}": (total - free) / gib,
    }


class HybridEngine:
    """Owns the actor's rollout engine and the transitions between training and rollout."""

    def __init__(
        self,
        model_dir: str | Path,
        layout: ParallelLayout,
        dims: ModelDims,
        actor,
        optimizer=None,
        *,
        engine_config: EngineConfig | None = None,
        bucket_bytes: int = 256 << 20,
        rollout: RolloutEngine | None = None,
        backend: str = "vllm",
        packing: bool = True,
        param_offload: bool = False,
    ):
        from megarl.models.dims import expert_offset, layer_offset

        layout.check_rollout()
        self.layout = layout
        self.dims = dims
        self.actor = actor
        self.optimizer = optimizer
        self.packing = packing  # actor.packing: the rollout is scored as one pack
        # actor.param_offload: the actor's memory on the host while the rollout engine generates
        self.param_offload = param_offload
        self._actor_moved = None
        self._onload_metrics: dict[str, float] = {}
        self.rank = dist.get_rank()
        self.pp_rank = parallel.pp_rank()
        self.dp_rank = parallel.dp_rank()
        self._layer_offset = layer_offset(dims, layout, self.pp_rank)
        self._expert_offset = expert_offset(dims, parallel.ep_rank(), layout.ep)
        if dims.is_moe and parallel.ep_rank() != self.dp_rank % layout.ep:
            raise RuntimeError(
                f"expert-parallel rank {parallel.ep_rank()} of DP replica {self.dp_rank}: the "
                "reshard plan assumes megatron's layout (EP rank = DP rank % ep)"
            )
        itemsize = next(actor.parameters()).element_size()
        specs = actor_tensor_specs(
            dims, layout.layers_per_stage(dims.num_layers), itemsize, ep=layout.ep
        )
        # vLLM's CPU and CUDA builds both load HF-layout tensors: full mode (every rank gets whole
        # tensors, vLLM cuts its shard). "shard" mode plans the zero-redundancy transition for
        # engines that accept pre-sharded tensors.
        self.plan = plan_reshard(
            specs,
            layout.tp,
            layout.pp,
            layout.dp,
            layout.rollout_tp,
            bucket_bytes,
            mode="full",
            ep=layout.ep,
        )
        self.executor = ReshardExecutor(self.plan, dims, self.rank)
        # rollout.dtype may differ from the actor's (e.g. bf16 training, fp32 sampling); an
        # engine handed in without its config is left to cast on load itself
        self.rollout_dtype: torch.dtype | None = None
        if rollout is None or engine_config is not None:
            self.rollout_dtype = ROLLOUT_DTYPES[(engine_config or EngineConfig()).dtype]
        self.hf_shapes = hf_output_shapes(self.plan, dims)
        expected = checkpoint_shapes(model_dir)
        check_rollout_model(self.hf_shapes, expected, dims.tie_word_embeddings)
        if rollout is not None and rollout.infer_tp != layout.rollout_tp:
            raise ValueError(
                f"the given rollout engine has infer_tp={rollout.infer_tp}, the layout "
                f"{layout.rollout_tp}"
            )
        # One engine per process: a later HybridEngine (e.g. another training layout) reuses it.
        self.rollout = rollout or make_rollout(
            backend, model_dir, layout.rollout_tp, engine_config, expected
        )
        self.last_reshard: ReshardStats | None = None
        self._grads_freed = False
        self._optimizer_offloaded = False
        self._rollouts = 0
        self.metrics: dict[str, float] = {}

    @property
    def rollout_count(self) -> int:
        """Rollouts generated so far; request seeds depend on it, so a resumed run restores it."""
        return self._rollouts

    @rollout_count.setter
    def rollout_count(self, value: int) -> None:
        self._rollouts = int(value)

    # -- transitions ---------------------------------------------------------------------------
    def to_rollout(self) -> dict[str, float]:
        """Free training-only memory, wake the rollout engine's weights, reshard the actor into
        them bucket by bucket, then wake its KV cache (so the reshard's buckets never share the
        GPU with a KV cache)."""
        self.rollout.validate(list(self.hf_shapes.items()))  # before anything is loaded
        freed = self._free_grads()
        if not self.param_offload:  # with it, the optimizer leaves with the weights below
            self._offload_optimizer()
        self.rollout.wake_up(["weights"])
        local = local_spec_tensors(
            self.actor, self.dims, self._layer_offset, self.plan.specs, self._expert_offset
        )
        if has_lora(self.actor):
            local = merged_local_tensors(self.actor, local, self.plan.specs, self._layer_offset)
        stats = self.executor.run(local, self._load_into_rollout)
        del local
        self.rollout.after_weight_update()
        offloaded = self._offload_actor()
        self.rollout.wake_up(["kv_cache"])
        self.last_reshard = stats
        self.metrics = {
            **stats.as_metrics(),
            "hybrid/grad_bytes_freed": float(freed),
            **offloaded,
            **gpu_memory_metrics("after_wake"),
        }
        return dict(self.metrics)

    def _load_into_rollout(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """One reshard bucket into the rollout engine, cast to its dtype (one bucket at a time)."""
        dtype = self.rollout_dtype
        if dtype is not None:
            weights = [(name, t.to(dtype)) for name, t in weights]
        self.rollout.update_weights(weights)

    def to_train(self) -> dict[str, float]:
        """Put the rollout engine to sleep and bring grads (and optimizer state) back; returns
        the GPU memory in use once it sleeps (empty on CPU)."""
        self.rollout.sleep()
        self._onload_actor()
        onloaded, self._onload_metrics = self._onload_metrics, {}
        self._restore_grads()
        self._onload_optimizer()
        return {**onloaded, **gpu_memory_metrics("after_sleep")}

    def _offload_actor(self) -> dict[str, float]:
        """With ``param_offload``: the actor's weights and optimizer states (its grads are freed
        already) to host memory; bytes moved and seconds."""
        if not self.param_offload or self._actor_moved is not None:
            return {}
        from megarl.models.offload import model_tensors, offload

        self._actor_moved = offload(model_tensors(self.actor, self.optimizer))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {
            "offload/actor_bytes": float(self._actor_moved.bytes_moved),
            "offload/actor_offload_s": self._actor_moved.seconds,
        }

    def _onload_actor(self) -> None:
        """The actor's offloaded memory back on its device (before it scores the rollout); the
        seconds are reported by :meth:`to_train`."""
        if self._actor_moved is None:
            return
        from megarl.models.offload import onload

        self._onload_metrics = {"offload/actor_onload_s": onload(self._actor_moved)}
        self._actor_moved = None

    def _grad_buffers(self):
        return list(getattr(self.actor, "buffers", [])) + list(
            getattr(self.actor, "expert_parallel_buffers", [])
        )

    def _free_grads(self) -> int:
        """Release megatron DDP's grad buffers (zeroed at the next step anyway)."""
        if self._grads_freed:
            return 0
        freed = 0
        for buf in self._grad_buffers():
            storage = buf.grad_data.untyped_storage()
            freed += storage.nbytes()
            storage.resize_(0)
        self._grads_freed = bool(self._grad_buffers())
        return freed

    def _restore_grads(self) -> None:
        if not self._grads_freed:
            return
        for buf in self._grad_buffers():
            data = buf.grad_data
            data.untyped_storage().resize_(data.numel() * data.element_size())
            data.zero_()
        self._grads_freed = False

    def _optimizer_state_tensors(self):
        # megatron chains one optimizer per parameter kind (MoE: dense and expert parameters)
        chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        out = []
        for opt in chained:
            inner = getattr(opt, "optimizer", None)
            if inner is None or not hasattr(inner, "state"):
                continue
            out += [
                (state, key)
                for state in inner.state.values()
                for key, value in state.items()
                if isinstance(value, torch.Tensor)
            ]
        return out

    def _offload_optimizer(self) -> None:
        """GPU: move Adam moments to host memory during rollout. CPU: nothing to gain."""
        if not torch.cuda.is_available() or self._optimizer_offloaded:
            return
        for state, key in self._optimizer_state_tensors():
            state[key] = state[key].to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._optimizer_offloaded = True

    def _onload_optimizer(self) -> None:
        if not self._optimizer_offloaded:
            return
        device = platform.device()
        for state, key in self._optimizer_state_tensors():
            state[key] = state[key].to(device, non_blocking=True)
        torch.cuda.synchronize()
        self._optimizer_offloaded = False

    # -- rollout -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        score_with_actor: bool = True,
    ) -> RolloutBatch:
        """Responses for this DP rank's prompts (identical on all ranks of a DP rank).

        The prompts of all DP ranks are split over the vLLM engines; request seeds depend only on
        the global prompt index and the rollout count, so samples do not depend on the layout.
        With ``score_with_actor`` the actor's teacher-forced logprobs come back too (usable as the
        old logprobs) and the mismatch with vLLM's is in ``batch.metrics``.
        """
        world = dist.get_world_size()
        mine = [list(map(int, p)) for p in prompts]
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (self.dp_rank, mine))
        per_dp: dict[int, list[list[int]]] = {}
        for d, p in gathered:
            per_dp.setdefault(d, p)
        order = sorted(per_dp)
        offsets, all_prompts = {}, []
        for d in order:
            offsets[d] = len(all_prompts)
            all_prompts += per_dp[d]
        engines = self.layout.rollout_dp
        engine = self.rank // self.layout.rollout_tp
        lo = engine * len(all_prompts) // engines
        hi = (engine + 1) * len(all_prompts) // engines
        seed_offset = lo + self._rollouts * max(1, len(all_prompts))
        self._rollouts += 1
        out = self.rollout.generate(all_prompts[lo:hi], sampling, seed_offset=seed_offset)
        results: list = [None] * world
        dist.all_gather_object(results, (engine, lo, out))
        merged = RolloutOutput()
        seen = set()
        for e, start, o in sorted(results, key=lambda x: x[0]):
            if e not in seen:
                seen.add(e)
                merged.extend(o, index_offset=start)
        a, b = offsets[self.dp_rank], offsets[self.dp_rank] + len(mine)
        keep = [k for k, i in enumerate(merged.prompt_index) if a <= i < b]
        output = RolloutOutput(
            prompt_index=[merged.prompt_index[k] - a for k in keep],
            token_ids=[merged.token_ids[k] for k in keep],
            logprobs=[merged.logprobs[k] for k in keep],
            finish_reasons=[merged.finish_reasons[k] for k in keep],
        )
        batch = RolloutBatch(prompts=mine, output=output)
        if score_with_actor:
            self._onload_actor()
            score_batch(self.actor, self.dims, self.packing, batch, sampling)
            self.metrics.update(batch.metrics)
        return batch

    def actor_logprobs(
        self,
        sequences: list[list[int]],
        pad_id: int = 0,
        starts: list[int] | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """:func:`actor_logprobs` of this engine's actor."""
        return actor_logprobs(
            self.actor, self.dims, self.packing, sequences, pad_id, starts, temperature
        )


def score_batch(
    actor, dims: ModelDims, packing: bool, batch: RolloutBatch, sampling: SamplingConfig
) -> None:
    """The actor's teacher-forced logprobs of ``batch``'s responses (the old logprobs) and the
    rollout-vs-actor mismatch into ``batch`` (a collective over the world)."""
    starts = [len(batch.prompts[i]) - 1 for i in batch.output.prompt_index]
    # vLLM returns the logprobs of the distribution it sampled from (logits / temperature):
    # the actor scores the same one, so the mismatch compares like with like.
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    t0 = time.perf_counter()
    batch.actor_logprobs = actor_logprobs(
        actor, dims, packing, batch.sequences(), starts=starts, temperature=temperature
    )
    batch.score_seconds = time.perf_counter() - t0
    diffs = [
        (torch.tensor(v, dtype=torch.float32, device=a.device) - a.float()).abs()
        for v, a in zip(batch.output.logprobs, batch.response_actor_logprobs(), strict=True)
    ]
    flat = torch.cat(diffs) if diffs else torch.zeros(0, device=platform.device())
    batch.metrics = {**batch.metrics, **logprob_mismatch(flat, dims.is_moe)}


@torch.no_grad()
def actor_logprobs(
    actor,
    dims: ModelDims,
    packing: bool,
    sequences: list[list[int]],
    pad_id: int = 0,
    starts: list[int] | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Teacher-forced logprobs of tokens 1.. of each (right-padded) sequence, ``[N, L-1]``, on
    every rank, under ``softmax(logits / temperature)``. With ``starts`` only positions
    ``starts[i]..`` of row i are computed (the response: the output layer skips the prompt);
    the others are 0. ``packing``: the sequences run as one pack (actor.packing)."""
    from megarl.models.logprobs import pad_right, positions_from, teacher_forced_log_probs

    device = next(actor.parameters()).device
    ids = pad_right(sequences, pad_id, device)
    length = ids.shape[1]
    first_rows = starts if starts is not None else [0] * len(sequences)
    first = torch.tensor(first_rows, dtype=torch.long, device=device)
    positions = positions_from(first, length - 1 - min(first_rows), length)
    seq_lens = None
    if packing:
        seq_lens = torch.tensor([len(s) for s in sequences], dtype=torch.long, device=device)
    logp = teacher_forced_log_probs(
        actor, ids, positions, dims.vocab_size, temperature, seq_lens=seq_lens
    )
    # column L-1 collects the positions clamped past a sequence's end; it is dropped
    out = torch.zeros(len(sequences), length, dtype=torch.float32, device=logp.device)
    out.scatter_(1, positions.to(logp.device), logp)
    return out[:, :-1].contiguous()
