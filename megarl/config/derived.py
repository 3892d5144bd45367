"""Values a run derives from several settings: the dtype names on this device, the trainer's
and the whole job's world sizes, the sequence budget."""

from __future__ import annotations

from megarl.config.schema import (
    EngineSettings,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
)


def trainer_world_size(parallel: ParallelConfig, rollout: RolloutConfig, world_size: int) -> int:
    """Processes that train: the whole job, less the rollout group in async mode."""
    return world_size - parallel.rollout_ranks if rollout.placement.mode == "async" else world_size


# The trainers that learn from a dataset of finished sequences (no rollout), each with a section
# of its own name that has a max_length.
SUPERVISED_KINDS = ("reward_model", "sft", "dpo")


def job_world_size(parallel: ParallelConfig, rollout: RolloutConfig) -> int:
    """The smallest job: one tp x pp trainer replica (and the rollout group)."""
    extra = parallel.rollout_ranks if rollout.placement.mode == "async" else 0
    return parallel.tp * parallel.pp + extra


def sequence_budget(cfg: RunConfig) -> tuple[int, str]:
    """The longest sequence a run trains on, and the settings that make it up."""
    if cfg.trainer.kind in SUPERVISED_KINDS:  # one max_length setting per such trainer
        section = cfg.trainer.kind
        return getattr(cfg, section).max_length, f"{section}.max_length"
    return (
        cfg.data.max_prompt_length + cfg.rollout.sampling.max_response_length,
        "data.max_prompt_length + rollout.sampling.max_response_length",
    )


def model_dtype(model: ModelConfig, cuda: bool) -> str:
    """The models' dtype name: model.dtype, where auto is bfloat16 on CUDA and float32 on CPU."""
    if model.dtype == "auto":
        return "bfloat16" if cuda else "float32"
    return model.dtype


def rollout_dtype(model: ModelConfig, engine: EngineSettings, cuda: bool) -> str:
    """The rollout engine's dtype name: rollout.engine.dtype, where auto is the models' dtype."""
    return model_dtype(model, cuda) if engine.dtype == "auto" else engine.dtype


def routing_recorded(engine: EngineSettings, moe: bool) -> bool:
    """Whether the rollout records each token's experts: an MoE policy on the HF backend,
    colocated or in the asynchronous rollout group (partial rounds included), single-turn,
    multi-turn (rollout.env) or an agent's (rollout.agent); the input checks refuse
    actor.router_replay with vLLM, whose routed experts are not read yet."""
    return moe and engine.backend == "hf"
