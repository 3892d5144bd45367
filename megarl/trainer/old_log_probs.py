"""Where the old logprobs of the policy ratio come from, and the rollout mismatch measured on them.

The PPO ratio compares the policy being updated with the one that the batch was sampled from:
``old_log_prob`` is the actor's logprob of each response token before any update on the batch.
By default the trainer computes it after the rollout (:func:`score_old_log_probs`), once the
rollout engine sleeps, in a separate forward-only pass through the pipeline in the update's
micro-batches (``actor.micro_batch_size`` sequences, or ``actor.max_tokens_per_micro_batch``
tokens, packed as the update packs them): its peak memory is one micro-batch's, whatever the
rollout's size. When the batch gets exactly one optimizer step, the update's own forward
runs at those same weights, on the same tokens, with the same temperature, so its logprobs
(detached) *are* the old ones: the separate pass can be skipped
(``actor.old_log_prob_forward=auto``) and the rollout-vs-trainer mismatch metrics are measured on
the update's forward instead. The ratio is then exactly 1 in the update, instead of 1 up to float
rounding between two forwards of different batch shapes.
"""

from __future__ import annotations

import torch

from megarl.config import ActorConfig, AlgorithmConfig
from megarl.rollout.mismatch import logprob_mismatch
from megarl.trainer.batch import Samples
from megarl.trainer.model_ops import MicroBatching, policy_log_probs
from megarl.trainer.routing_flags import AGREED, FLIPPED, flags_buffer


def separate_forward_reasons(
    a: AlgorithmConfig, actor: ActorConfig, train_batch_size: int
) -> list[str]:
    """Why a run with these ``algorithm`` and ``actor`` sections and ``data.train_batch_size``
    needs old logprobs from a separate forward before the update (empty: the update's own
    forward gives them)."""
    reasons = []
    if actor.old_log_prob_forward == "always":
        reasons.append("actor.old_log_prob_forward=always")
    if actor.ppo_epochs > 1:
        reasons.append(f"actor.ppo_epochs={actor.ppo_epochs}: later epochs see moved weights")
    if actor.ppo_mini_batch_size < train_batch_size:
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
    if a.distill.teacher_path is not None and a.distill.mode == "reward":
        reasons.append("algorithm.distill.mode=reward: the KL reward is computed before the update")
    if actor.lora.rank > 0 and actor.lora.dropout > 0:
        reasons.append("actor.lora.dropout > 0: the update's forward is not the policy's")
    return reasons


def old_log_prob_from_update(a: AlgorithmConfig, actor: ActorConfig, train_batch_size: int) -> bool:
    """Whether the update's own (detached) logprobs are the old ones, with no separate forward."""
    return not separate_forward_reasons(a, actor, train_batch_size)


def score_old_log_probs(
    actor: torch.nn.Module,
    samples: Samples,
    vocab_size: int,
    temperature: float,
    batching: MicroBatching,
    is_moe: bool,
) -> dict[str, float]:
    """The actor's logprobs of the sampled tokens as ``samples.tensors.old_log_prob`` (of
    ``softmax(logits / temperature)``, the distribution the rollout sampled from) in
    ``batching``'s micro-batches, and the rollout-vs-trainer mismatch measured on them. Collective
    over the world; run it after the rollout engine sleeps."""
    flags = flags_buffer(samples)
    samples.tensors.old_log_prob = policy_log_probs(
        actor, samples, vocab_size, temperature, batching, flags
    )
    return rollout_mismatch(samples, is_moe, flags)


def rollout_mismatch(
    samples: Samples, is_moe: bool, routing_flags: torch.Tensor | None = None
) -> dict[str, float]:
    """The rollout-vs-trainer logprob mismatch of a batch carrying ``old_log_prob``, from the
    scoring pass or from the update's forward: the same metrics either way (a collective over
    the world); an MoE model's split by the routing of the forward that gave them
    (``routing_flags``, megarl.trainer.routing_flags; None: every token unrecorded)."""
    rollout = samples.tensors.require("rollout_log_prob")
    old = samples.tensors.require("old_log_prob")
    mask = samples.response_mask.bool()
    diffs = (rollout - old.to(rollout.device)).abs()
    kept = mask.to(diffs.device)
    if routing_flags is None:
        return logprob_mismatch(diffs[kept].float(), is_moe)
    codes = routing_flags.to(diffs.device)[kept]
    return logprob_mismatch(diffs[kept].float(), is_moe, codes == AGREED, codes == FLIPPED)


__all__ = [
    "old_log_prob_from_update",
    "rollout_mismatch",
    "score_old_log_probs",
    "separate_forward_reasons",
]
