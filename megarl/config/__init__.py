"""The typed run configuration: one dataclass per section, one default per setting.

A run is a YAML file plus dotted overrides (``actor.optim.lr=1e-6``), merged onto these
dataclasses by OmegaConf. Unknown keys (named in full, with megarl's key for verl's: see
:mod:`megarl.config_keys`), wrong types and inconsistent batch sizes are :class:`ConfigError` s
that name the setting and the fix, raised before any model or process starts.

The package: ``schema`` (the dataclasses), ``words`` (the valid words of ``Literal`` settings),
``loading`` (YAML + overrides -> a checked config), ``validation`` (the cross-setting checks).
"""

from megarl.config.derived import (
    job_world_size,
    model_dtype,
    rollout_dtype,
    sequence_budget,
    trainer_world_size,
)
from megarl.config.literals import (
    DistillMode,
    Dtype,
    NanPolicy,
    OldLogProbForward,
    OverlongPrompts,
    Recompute,
    ReshardMode,
    ResumeMode,
    RolloutBackend,
    RolloutMode,
    SleepLevel,
    TrainerKind,
    TransformerImpl,
    Truncation,
    WandbMode,
)
from megarl.config.loading import load_config, to_flat_dict
from megarl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    DistillConfig,
    DPOConfig,
    ElasticConfig,
    JudgeConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    OverlongBufferConfig,
    ParallelConfig,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    RunConfig,
    SFTConfig,
    TrainerConfig,
)
from megarl.config.validation import validate
from megarl.config.words import choices

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "DistillConfig",
    "DistillMode",
    "Dtype",
    "ElasticConfig",
    "JudgeConfig",
    "LoraConfig",
    "ModelConfig",
    "NanPolicy",
    "OldLogProbForward",
    "OptimConfig",
    "OverlongBufferConfig",
    "OverlongPrompts",
    "ParallelConfig",
    "Recompute",
    "RefConfig",
    "ReshardMode",
    "ResumeMode",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutBackend",
    "RolloutConfig",
    "RolloutMode",
    "RunConfig",
    "SFTConfig",
    "SleepLevel",
    "TrainerConfig",
    "TrainerKind",
    "TransformerImpl",
    "Truncation",
    "WandbMode",
    "choices",
    "job_world_size",
    "load_config",
    "model_dtype",
    "rollout_dtype",
    "sequence_budget",
    "to_flat_dict",
    "trainer_world_size",
    "validate",
]
