"""Rule rewards: scorers by data_source (gsm8k, ...) and the reward manager that runs them."""

from megarl.rewards.manager import RewardError, RewardManager, RewardResult, RewardSample
from megarl.rewards.registry import BUILTIN_SCORERS

__all__ = ["BUILTIN_SCORERS", "RewardError", "RewardManager", "RewardResult", "RewardSample"]
