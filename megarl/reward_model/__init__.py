"""The reward-model trainer (``megarl train-rm``): Bradley-Terry training on preference pairs.
Scoring with a trained reward model is a reward source: :mod:`megarl.rewards.model`."""
