"""Rewards: rule scorers by data_source (gsm8k, ...) with the reward manager that runs them, and a
trained reward model as a second source (:mod:`megarl.rewards.model`)."""

from megarl.rewards.manager import RewardError, RewardManager, RewardResult, RewardSample
from megarl.rewards.registry import BUILTIN_SCORERS

__all__ = ["BUILTIN_SCORERS", "RewardError", "RewardManager", "RewardResult", "RewardSample"]
