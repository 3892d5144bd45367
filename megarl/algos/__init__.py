"""RL algorithms as pure tensor functions, chosen by config words through registries.

Nothing here imports megatron or vLLM. Tensors are [batch, response_len] with a 0/1 response mask
unless said otherwise. Importing the package registers every built-in name.
"""

from megarl.algos.advantages import ADV_ESTIMATORS, compute_advantages, register_adv_estimator
from megarl.algos.aggregation import AGG_MODES, agg_loss
from megarl.algos.dpo import DPO_LOSSES, dpo_loss, register_dpo_loss
from megarl.algos.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)
from megarl.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megarl.algos.policy_loss import (
    POLICY_LOSS_REDUCTIONS,
    POLICY_LOSSES,
    compute_policy_loss,
    register_policy_loss,
)
from megarl.algos.preference import bradley_terry_loss
from megarl.algos.registry import DuplicateNameError, Registry, UnknownNameError
from megarl.algos.rollout_correction import (
    ROLLOUT_CORRECTION_REDUCTIONS,
    ROLLOUT_CORRECTIONS,
    compute_rollout_correction,
    register_rollout_correction,
    rollout_mismatch_metrics,
)
from megarl.algos.value_loss import (
    compute_entropy_loss,
    compute_value_loss,
    entropy_bonus,
    explained_variance,
    explained_variance_from_sums,
    explained_variance_sums,
)
from megarl.algos.vocab_parallel import (
    entropy_from_logits,
    log_probs_from_logits,
    vocab_parallel_entropy,
    vocab_parallel_is_argmax,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "DPO_LOSSES",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "POLICY_LOSS_REDUCTIONS",
    "ROLLOUT_CORRECTIONS",
    "ROLLOUT_CORRECTION_REDUCTIONS",
    "AdaptiveKLController",
    "DuplicateNameError",
    "FixedKLController",
    "Registry",
    "UnknownNameError",
    "agg_loss",
    "apply_kl_in_reward",
    "bradley_terry_loss",
    "compute_advantages",
    "compute_entropy_loss",
    "compute_policy_loss",
    "compute_rollout_correction",
    "compute_value_loss",
    "dpo_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "explained_variance",
    "explained_variance_from_sums",
    "explained_variance_sums",
    "kl_loss",
    "kl_penalty",
    "log_probs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_estimator",
    "register_dpo_loss",
    "register_policy_loss",
    "register_rollout_correction",
    "rollout_mismatch_metrics",
    "vocab_parallel_entropy",
    "vocab_parallel_is_argmax",
    "vocab_parallel_log_probs",
    "vocab_parallel_log_probs_and_entropy",
]
