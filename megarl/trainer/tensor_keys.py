"""The keys of ``Samples.tensors`` (:class:`megarl.trainer.batch.Samples`): every per-token tensor
a step's samples carry between its phases, each ``[samples, max_response_len]`` in response space,
named once here. A key is absent until the phase that fills it has run.
"""

from __future__ import annotations

# the rollout engine's logprob of each sampled token (trainer.experience.build_samples)
ROLLOUT_LOG_PROB = "rollout_log_prob"
# the outcome score (and a multi-turn trajectory's turn rewards) on their tokens, before the KL
# penalty (trainer.experience.set_outcome_scores / set_trajectory_scores)
TOKEN_LEVEL_SCORES = "token_level_scores"
# the actor's logprobs before the update: the scoring pass (trainer.old_log_probs) or, when the
# batch gets one optimizer step, the update's own forward (the actor loss returns them under this
# name among its metrics; trainer.model_ops.ppo_update gathers them)
OLD_LOG_PROB = "old_log_prob"
# the reference model's logprobs (trainer.experience.compute_experience), for the KL terms
REF_LOG_PROB = "ref_log_prob"
# the frozen teacher's logprobs (algorithm.distill: trainer.distill)
TEACHER_LOG_PROB = "teacher_log_prob"
# the critic's values, and the scores less the KL penalty in the reward (compute_experience)
VALUES = "values"
TOKEN_LEVEL_REWARDS = "token_level_rewards"
# the advantage estimator's outputs (compute_experience; algorithm.distill's reward mode adds its
# reverse-KL term to the advantages)
ADVANTAGES = "advantages"
RETURNS = "returns"
# the importance weights of algorithm.rollout_correction (absent: none)
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"
