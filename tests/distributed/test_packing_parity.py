"""Packed micro-batches (actor.packing) equal padded ones at TP2xPP2 with sequence parallelism.

One 4-rank launch checks every RL forward and backward on a batch of very unequal lengths
(responses of 1 to 57 tokens), fp32: old/reference logprobs (micro-batched), the rollout's
teacher-forced scoring (one pack), the PPO actor loss and its gradients, critic values and
reward-model scores; and shared-prompt packs (actor.share_prompts: each distinct prompt once per
micro-batch, its samples' responses after it) against plain packs on groups of samples of one
prompt: logprobs, the PPO loss, its gradients and critic values. Tolerance 1e-6: absolute for values, scores and gradients; relative to the
size (at least 1) for logprobs and the loss, since fp32 numbers near 10 lie 9.5e-7 apart. The
packed logprobs also equal transformers' on each unpadded sequence within 1e-5.
"""

from __future__ import annotations

from tests.assets import tiny_qwen2_dir
from tests.distributed import packing_workers as w
from tests.mp import run_gloo


def test_packed_equals_padded_at_tp2_pp2_and_dp_token_balance():
    results = run_gloo(w.packing_worker, 4, str(tiny_qwen2_dir()))
    merged: dict[str, float] = {}
    for r in results:
        for k, v in r.items():
            merged[k] = max(v, merged.get(k, 0.0))
    print(merged)  # the measured figures, for the log
    for key in ("logprobs", "rollout_logprobs", "values", "scores", "grads"):
        assert merged[key] <= 1e-6, (key, merged)
    # what is compared is not all zero
    assert merged["grad_scale"] > 1e-4 and merged["value_scale"] > 1e-4, merged
    assert merged["loss"] <= 1e-6 * max(1.0, merged["loss_value"]), merged
    assert merged["packed_vs_hf"] <= 1e-5, merged
    # actor.share_prompts (each prompt once per micro-batch) against plain packing, same launch
    assert merged["shared_logprobs"] <= 1e-6 and merged["shared_values"] <= 1e-6, merged
    assert merged["shared_loss"] <= 1e-6 * max(1.0, merged["shared_loss_value"]), merged
    assert merged["shared_grads"] <= 1e-6, merged
    assert merged["shared_grad_scale"] > 1e-4 and merged["shared_value_scale"] > 1e-4, merged
    # The same launch, 4 DP ranks: the DP token balance re-deals whole groups (rank 0 drew all
    # the long responses), keeps every sample with its tensors and score, and meets its bound.
    assert merged["balance_same_samples"] == 1.0 and merged["balance_whole_groups"] == 1.0
    assert merged["balance_heaviest_minus_bound"] <= 0.0, merged
    assert merged["balance_imbalance_before"] > 1.0, merged
    assert merged["balance_imbalance_after"] < merged["balance_imbalance_before"] / 2, merged
