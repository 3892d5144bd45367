"""The 3D-HybridEngine: the actor trains in megatron's TP x PP x DP layout and rolls out in vLLM's.

The engine does the rollout and the resharding, nothing else; the trainer drives it
(:mod:`megarl.trainer.rollout`)::

    engine.to_rollout()                  # reshard weights bucket by bucket into vLLM, wake vLLM
    batch = engine.generate(prompts, sampling)
    engine.to_train()                    # vLLM sleeps

What the trainer does around it (freeing the actor's grads, moving optimizer state or whole models
to the host, scoring the responses with the actor) is trainer code
(:mod:`megarl.trainer.rollout_offload`, :mod:`megarl.trainer.old_log_probs`).

Resharding follows a pure plan (:mod:`megarl.weights.reshard_schedule`) computed identically on every
rank; the executor (:mod:`megarl.weights.execute`) moves each bucket (the next one travelling
while the current one loads) and hands it to the rollout engine in Hugging Face layout, cast to the
rollout's dtype (``rollout.engine.dtype``): in ``shard`` mode only the slices this rank's rollout TP rank
loads, in ``full`` mode whole tensors (:mod:`megarl.weights.reshard_mode`). Rollout prompts: each
training DP rank passes its own prompts; they are spread over the ``world / infer_tp`` vLLM engines
and every rank gets back the responses of its DP rank (the slicing, seeding and merging are
:mod:`megarl.rollout.rollout_split`, shared with the asynchronous rollout group).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from megarl import parallel, platform
from megarl.backends import check_rollout_backend
from megarl.dtypes import dtype_from_name
from megarl.models.dims import ModelDims, expert_offset, layer_offset
from megarl.models.lora import has_lora
from megarl.parallel import ParallelLayout
from megarl.rollout.engine_folder import checkpoint_shapes
from megarl.rollout.engine_group import engine_group, share_from_first
from megarl.rollout.hf_rollout import HFRollout
from megarl.rollout.one_reply import OneReplySource
from megarl.rollout.rollout_batch import RolloutBatch, rank_batch
from megarl.rollout.rollout_split import (
    one_per_key,
    rank_bounds,
    rank_engine_slice,
    sample_starts,
)
from megarl.rollout.rollout_types import (
    EngineConfig,
    RolloutEngine,
    SamplingConfig,
)
from megarl.rollout.trajectory_source import EngineJob, TrajectorySource, step_of
from megarl.rollout.vllm_rollout import VLLMRollout
from megarl.weights.execute import (
    ReshardExecutor,
    ReshardStats,
    hf_output_shapes,
    local_spec_tensors,
)
from megarl.weights.lora_merge import merged_local_tensors
from megarl.weights.reshard_mode import resolve_reshard_mode
from megarl.weights.reshard_schedule import schedule_reshard
from megarl.weights.tensor_list import actor_planned_tensors

T = TypeVar("T")


def check_rollout_model(
    produced: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], tied: bool
) -> None:
    """The reshard output must be exactly the rollout model's tensors (names and shapes)."""
    for name, shape in produced.items():
        if name not in expected:
            raise ValueError(
                f"reshard schedule produces {name!r}, which the rollout model does not have"
            )
        if tuple(expected[name]) != tuple(shape):
            raise ValueError(
                f"reshard schedule produces {name!r} with shape {list(shape)} but the rollout model "
                f"expects {list(expected[name])}"
            )
    missing = [n for n in expected if n not in produced and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(
            f"reshard schedule does not produce the rollout model's tensor {missing[0]!r}"
        )


def _vllm_rollout(*args) -> RolloutEngine:
    return VLLMRollout(*args)


def _hf_rollout(*args) -> RolloutEngine:

    return HFRollout(*args)


# rollout.engine.backend -> engine constructor (model_dir, infer_tp, EngineConfig, expected shapes)
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
    """The rollout engine ``rollout.engine.backend`` names, over this rank's inference-TP group."""

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
        *,
        engine_config: EngineConfig | None = None,
        bucket_bytes: int = 256 << 20,
        rollout: RolloutEngine | None = None,
        backend: str = "vllm",
        multi_turn: bool = False,
        reshard_mode: str = "auto",
    ):

        layout.check_rollout()
        self.layout = layout
        self.dims = dims
        self.actor = actor
        self.rank = dist.get_rank()
        self.pp_rank = parallel.pp_rank()
        self.dp_rank = parallel.dp_rank()
        self._layer_offset = layer_offset(dims, layout, self.pp_rank)
        self._expert_offset = expert_offset(dims, parallel.ep_rank(), layout.ep)
        if dims.is_moe and parallel.ep_rank() != self.dp_rank % layout.ep:
            raise RuntimeError(
                f"expert-parallel rank {parallel.ep_rank()} of DP replica {self.dp_rank}: the "
                "reshard schedule assumes megatron's layout (EP rank = DP rank % ep)"
            )
        itemsize = next(actor.parameters()).element_size()
        specs = actor_planned_tensors(
            dims, layout.layers_per_stage(dims.num_layers), itemsize, ep=layout.ep
        )
        # rollout.engine.reshard_mode: shard (each rank receives only what its rollout TP rank loads)
        # wherever the backend can load slices of this model, else full (whole tensors)
        # (an engine handed in that implements only update_weights takes whole tensors)
        if rollout is not None and not hasattr(rollout, "load_shards") and reshard_mode == "auto":
            reshard_mode = "full"
        self.reshard_mode = resolve_reshard_mode(
            reshard_mode, getattr(rollout, "backend", backend), dims.is_moe
        )
        self.plan = schedule_reshard(
            specs,
            layout.tp,
            layout.pp,
            layout.dp,
            layout.rollout_tp,
            bucket_bytes,
            mode=self.reshard_mode,
            ep=layout.ep,
            # slices come from a holder on the receiver's node where there is one (torchrun
            # starts the same number of ranks per node: every rank plans alike)
            ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None,
        )
        self.executor = ReshardExecutor(self.plan, dims, self.rank)
        # rollout.engine.dtype may differ from the actor's (e.g. bf16 training, fp32 sampling); an
        # engine handed in without its config is left to cast on load itself
        self.rollout_dtype: torch.dtype | None = None
        if rollout is None or engine_config is not None:
            self.rollout_dtype = dtype_from_name((engine_config or EngineConfig()).dtype)
        self.hf_shapes = hf_output_shapes(self.plan, dims)
        # shard mode: the slices this rank hands its rollout engine (checked before each load)
        self.shard_specs = self.executor.shard_specs() if self.reshard_mode == "shard" else []
        expected = checkpoint_shapes(model_dir)
        check_rollout_model(self.hf_shapes, expected, dims.tie_word_embeddings)
        if rollout is not None and rollout.infer_tp != layout.rollout_tp:
            raise ValueError(
                f"the given rollout engine has infer_tp={rollout.infer_tp}, the layout "
                f"{layout.rollout_tp}"
            )
        # One engine per process: a later HybridEngine (e.g. another training layout) reuses it.
        # An engine built here starts from dummy weights: every one of them arrives with the
        # first reshard, before anything is generated (vLLM skips reading the checkpoint).
        self.rollout = rollout or make_rollout(
            backend,
            model_dir,
            layout.rollout_tp,
            replace(engine_config or EngineConfig(), load_format="dummy"),
            expected,
        )
        self.last_reshard: ReshardStats | None = None
        # rollouts generated so far: request seeds depend on it, so a resumed run restores it
        self.rollout_count = 0
        self.metrics: dict[str, float] = {}
        # multi-turn: environments run on the first rank of each rollout engine, their results
        # broadcast over the engine's ranks (a group per engine, made by every rank together)
        self._engine_leader = self.rank - self.rank % layout.rollout_tp
        self._engine_group = (
            engine_group(layout.world_size, layout.rollout_tp, self.rank) if multi_turn else None
        )

    # -- transitions ---------------------------------------------------------------------------
    def to_rollout(
        self, before_kv_cache: Callable[[], dict[str, float]] | None = None
    ) -> dict[str, float]:
        """Wake the rollout engine's weights, reshard the actor into them bucket by bucket, then
        wake its KV cache (so the reshard's buckets never share the GPU with a KV cache).

        ``before_kv_cache``: the trainer's hook between the two (e.g. the actor's weights to the
        host once the reshard has read them); its metrics join the reshard's."""
        # before anything is loaded
        if self.reshard_mode == "shard":
            self.rollout.validate_shards(self.shard_specs)
        else:
            self.rollout.validate(list(self.hf_shapes.items()))
        self.rollout.wake_up(["weights"])
        stats = self.reshard(self._load_into_rollout)
        self.rollout.after_weight_update()
        hooked = before_kv_cache() if before_kv_cache is not None else {}
        self.rollout.wake_up(["kv_cache"])
        self.last_reshard = stats
        self.metrics = {**stats.as_metrics(), **hooked, **gpu_memory_metrics("after_wake")}
        return dict(self.metrics)

    def reshard(self, sink: Callable[[list], None]) -> ReshardStats:
        """Run this rank's part of the reshard schedule, bucket by bucket, into ``sink`` (the
        rollout engine's load in :meth:`to_rollout`): the actor's weights (LoRA adapters merged)
        as ``(hf_name, tensor)`` in full mode, ``(ShardSlice, slice)`` in shard mode."""
        local = local_spec_tensors(
            self.actor, self.dims, self._layer_offset, self.plan.specs, self._expert_offset
        )
        if has_lora(self.actor):
            local = merged_local_tensors(self.actor, local, self.plan.specs, self._layer_offset)
        return self.executor.run(local, sink)

    def _load_into_rollout(self, weights: list) -> None:
        """One reshard bucket into the rollout engine, cast to its dtype (one bucket at a time):
        ``(hf_name, tensor)`` pairs in full mode, ``(ShardSlice, slice)`` in shard mode."""
        dtype = self.rollout_dtype
        if dtype is not None:
            weights = [(key, t.to(dtype)) for key, t in weights]
        if self.reshard_mode == "shard":
            self.rollout.load_shards(weights)
        else:
            self.rollout.update_weights(weights)

    def to_train(self) -> None:
        """Put the rollout engine to sleep (its weights and KV cache leave the GPU)."""
        self.rollout.sleep()

    # -- rollout (the split over engines and back: megarl.rollout.rollout_split) -------
    def _gather_dp(self, mine: list[T]) -> tuple[list[T], int, int]:
        """Every DP rank's items in DP order, and this DP rank's [a, b) among them."""
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.dp_rank, mine))
        per_dp = one_per_key(gathered)
        bounds = rank_bounds([len(items) for _, items in per_dp])
        a, b = bounds[[d for d, _ in per_dp].index(self.dp_rank)]
        return [x for _, items in per_dp for x in items], a, b

    def _engine_slice(self, total: int) -> tuple[int, int, int]:
        """This rank's engine and the [lo, hi) of the step's ``total`` prompts it generates."""
        return rank_engine_slice(total, self.layout.world_size, self.layout.rollout_tp, self.rank)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Responses for this DP rank's prompts (identical on all ranks of a DP rank): the
        one-reply case of :meth:`generate_from`.

        The prompts of all DP ranks are split over the vLLM engines; every sample's seed depends
        only on its global index and the rollout count (:mod:`megarl.rollout.seeds`), so
        samples do not depend on the layout and no two share a random stream.
        """
        rows: list[dict] = [{} for _ in prompts]
        return self.generate_from(rows, prompts, max(1, sampling.n), OneReplySource(sampling))

    # -- multi-turn ----------------------------------------------------------------------------
    @property
    def runs_environments(self) -> bool:
        """Whether this rank executes environments (the first rank of its rollout engine)."""
        return self.rank == self._engine_leader

    def _share(self, value: T | None) -> T:
        """The engine leader's ``value`` on every rank of this rank's rollout engine."""
        return share_from_first(value, self._engine_group)

    def generate_from(
        self,
        rows: Sequence[dict],
        fallback_prompts: Sequence[Sequence[int]],
        n: int,
        source: TrajectorySource,
        max_failed_share: float = 1.0,
    ) -> RolloutBatch:
        """The trajectories ``source`` makes of this DP rank's dataset rows, ``n`` samples per
        row, like :meth:`generate`: rows of all DP ranks split over the engines, each engine's
        samples made by the source on the engine's ranks (its first rank's results kept). Raises
        EnvError (the first failure shown) when more than ``max_failed_share`` of the step's
        samples failed."""
        mine = [(dict(r), list(map(int, p))) for r, p in zip(rows, fallback_prompts, strict=True)]
        everything, a, b = self._gather_dp(mine)
        engine, lo, hi = self._engine_slice(len(everything))
        rollout_index = self.rollout_count
        self.rollout_count += 1
        starts = sample_starts(everything, lo, hi, n)
        leader = self.runs_environments
        part = source.run(EngineJob(self.rollout, starts, rollout_index, leader, self._share))
        results: list = [None] * dist.get_world_size()
        dist.all_gather_object(results, (engine, part) if leader else None)
        parts, step = step_of(results, max_failed_share)
        return rank_batch(step, a, b, n, source.conversations, source.step_metrics(parts))
