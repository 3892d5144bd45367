"""Where the old logprobs of the policy ratio come from, and the rollout mismatch measured on them.

The PPO ratio compares the policy being updated with the one that the batch was sampled from:
``old_log_prob`` is the actor's logprob of each response token before any update on the batch.
By default the hybrid engine computes it right after the rollout, in a separate forward pass
over every sequence. When the batch gets exactly one optimizer step, the update's own forward
runs at those same weights, on the same tokens, with the same temperature, so its logprobs
(detached) *are* the old ones: the separate pass can be skipped
(``actor.old_log_prob_forward=auto``) and the rollout-vs-trainer mismatch metrics are measured on
the update's forward instead. The ratio is then exactly 1 in the update, instead of 1 up to float
rounding between two forwards of different batch shapes.
"""

from __future__ import annotations

from megarl.config import RunConfig
from megarl.hybrid_engine.mismatch import logprob_mismatch
from megarl.trainer.batch import Samples

# The name under which the actor loss returns the update's detached logprobs ([b, R] per
# micro-batch) when they are the old ones; megarl.trainer.model_ops.ppo_update gathers them.
OLD_LOG_PROB = "old_log_prob"


def separate_forward_reasons(cfg: RunConfig) -> list[str]:
    """Why this run needs old logprobs from a separate forward before the update (empty: the
    update's own forward gives them)."""
    a, actor = cfg.algorithm, cfg.actor
    reasons = []
    if actor.old_log_prob_forward == "always":
        reasons.append("actor.old_log_prob_forward=always")
    if actor.ppo_epochs > 1:
        reasons.append(f"actor.ppo_epochs={actor.ppo_epochs}: later epochs see moved weights")
    if actor.ppo_mini_batch_size < cfg.data.train_batch_size:
        reasons.append(
            "actor.ppo_mini_batch_size < data.train_batch_size: later mini-batches see moved "
            "weights"
        )
    if a.rollout_correction != "none":
        reasons.append(
            f"algorithm.rollout_correction={a.rollout_correction}: its weights are computed "
            "before the update"
        )
    if a.use_kl_in_reward:
        reasons.append("algorithm.use_kl_in_reward: the KL penalty is computed before the update")
    if actor.lora.rank > 0 and actor.lora.dropout > 0:
        reasons.append("actor.lora.dropout > 0: the update's forward is not the policy's")
    return reasons


def old_log_prob_from_update(cfg: RunConfig) -> bool:
    """Whether the update's own (detached) logprobs are the old ones, with no separate forward."""
    return not separate_forward_reasons(cfg)


def update_mismatch_metrics(samples: Samples, is_moe: bool) -> dict[str, float]:
    """The rollout-vs-trainer logprob mismatch of a batch whose ``old_log_prob`` came from the
    update's forward: the same metrics the hybrid engine reports after its own scoring
    (a collective over the world)."""
    t = samples.tensors
    mask = samples.response_mask.bool()
    diffs = (t["rollout_log_prob"] - t[OLD_LOG_PROB].to(t["rollout_log_prob"].device)).abs()
    return logprob_mismatch(diffs[mask.to(diffs.device)].float(), is_moe)


__all__ = [
    "OLD_LOG_PROB",
    "old_log_prob_from_update",
    "separate_forward_reasons",
    "update_mismatch_metrics",
]
