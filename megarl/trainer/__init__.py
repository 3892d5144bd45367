"""The PPO/GRPO trainer: one loop (:mod:`megarl.trainer.loop`) over small, single-job modules."""
