"""The fixed word sets of the settings that take one word of a few, as ``Literal`` types."""

from __future__ import annotations

from typing import Literal

# The settings that take one of a fixed set of words: OmegaConf refuses any other value when the
# config loads (load_config names the valid ones), and validate() checks a config built in code.
# Words chosen through a registry (algorithm.*, dpo.loss) are checked by megarl.algos.choices.
Dtype = Literal["auto", "float32", "bfloat16"]
Recompute = Literal["none", "selective", "full"]
TransformerImpl = Literal["auto", "local", "transformer_engine"]
OverlongPrompts = Literal["filter", "error"]
RolloutBackend = Literal["vllm", "hf"]
SleepLevel = Literal[1, 2]
ReshardMode = Literal["auto", "shard", "full"]
RolloutMode = Literal["colocated", "async"]
TurnLoop = Literal["continuous", "lockstep"]
DistillMode = Literal["reward", "loss"]
OldLogProbForward = Literal["auto", "always"]
Truncation = Literal["error", "filter", "truncate"]
TrainerKind = Literal["policy", "reward_model", "sft", "dpo"]
ResumeMode = Literal["auto", "never"]
NanPolicy = Literal["stop", "skip"]
WandbMode = Literal["online", "offline", "disabled"]
