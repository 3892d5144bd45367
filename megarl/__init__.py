"""megarl: a Megatron-core based 3D-parallel RLHF engine (PPO, GRPO) with a colocated vLLM rollout."""

__version__ = "0.1.0"
