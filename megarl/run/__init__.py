"""What both trainers (PPO/GRPO in :mod:`megarl.trainer`, Bradley-Terry reward models in
:mod:`megarl.reward_model`) share: start-up, trainable models, resume and checkpoints, endless data
epochs, finiteness checks, tracking and the per-step log. Neither trainer imports the other."""
