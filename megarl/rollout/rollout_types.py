"""The rollout engines' seam types: how responses are sampled, how an engine is sized, what it
returns, how it is asked (:class:`Generates`), each request's seed, and what a backend is to the
trainer (:class:`RolloutEngine`: generation, weight updates, sleep and wake). Both engines
(:mod:`megarl.rollout.vllm_rollout`, :mod:`megarl.rollout.hf_rollout`) and everything that drives
them import these from here."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megarl.rollout.seeds import sequence_seed
from megarl.weights.weight_shards import ShardSlice, WeightShard


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled. ``temperature == 0`` is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 128
    n: int = 1  # samples per prompt (GRPO groups)
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS ids (generation config)
    seed: int = (
        0  # the run's seed: every sample's own stream derives from it (megarl.rollout.seeds)
    )
    # False: no request seeds, vLLM's batched sampler draws from the engine's generator (samples
    # then depend on the layout and the batching; rollout.sampling.per_request_seeds)
    per_request_seeds: bool = True
    ignore_eos: bool = False  # benchmarks: exactly max_new_tokens tokens per response


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 1024
    kv_cache_bytes: int = 256 << 20
    dtype: str = "float32"
    seed: int = 0
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.5  # CUDA: share of the GPU for vLLM's weights + KV cache
    # CUDA: 2 drops the weights while asleep (the next reshard refills every one), 1 keeps them
    # in host memory (copied out and back at every sleep)
    sleep_level: int = 2
    # actor.router_replay: record each token's routed experts (RolloutOutput.routes)
    record_routes: bool = False
    # "auto": read the checkpoint at start-up; "dummy": random weights, for an engine whose
    # first weight update delivers every tensor (the hybrid engine's reshard)
    load_format: str = "auto"


@dataclass
class RolloutOutput:
    """Responses in prompt-major order: sample j of prompt i is entry ``i * n + j``."""

    prompt_index: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    # multi-turn: 1 for each model token of a response, 0 for the environment's (empty: all 1)
    response_masks: list[list[int]] = field(default_factory=list)
    # actor.router_replay: per sample, the experts the engine routed each token of prompt +
    # response to, [tokens, MoE layers, top_k] int16 on the host, -1 where it routed none (empty:
    # not recorded)
    routes: list[torch.Tensor] = field(default_factory=list)


class Generates(Protocol):
    """What the rollout's drivers (the colocated step, the turn loop, the asynchronous rollout
    group's versioned generation, the agent endpoint) ask of an engine: ``sampling.n`` responses
    per prompt, request ``i`` seeded with ``seeds[i]`` when given (else :func:`request_seed` of
    ``seed_offset``), each capped at ``max_new_tokens[i]`` new tokens when given."""

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed_offset: int = 0,
        *,
        seeds: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> RolloutOutput: ...


def request_seed(
    sampling: SamplingConfig, seed_offset: int, index: int, seeds: Sequence[int] | None
) -> int:
    """The seed of request ``index`` of a generate call: its own when given (a run passes
    every request's, :mod:`megarl.rollout.seeds`); else, for a call outside a run, the
    stream of sample ``seed_offset + index * n`` of the run seed's rollout 0, so no two samples
    of the call share one."""
    if seeds is not None:
        return int(seeds[index])
    return sequence_seed(sampling.seed, 0, seed_offset + index * max(1, sampling.n))


class RolloutEngine(Generates, Protocol):
    """The seam between the trainer and a rollout backend (vLLM, or transformers' generate):
    :class:`Generates`, weight updates (whole tensors, or the slices of :mod:`megarl.weights.weight_shards`),
    sleep and wake. The hybrid engine and the asynchronous rollout group drive it; both backends
    implement it."""

    infer_tp: int
    backend: str  # its rollout.engine.backend name

    def validate(self, weights: Sequence[tuple[str, torch.Tensor | tuple[int, ...]]]) -> None: ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def validate_shards(self, shards: Sequence[ShardSlice]) -> None: ...

    def load_shards(self, shards: Sequence[WeightShard]) -> None: ...

    def after_weight_update(self) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...
