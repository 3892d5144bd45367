"""Reward model at TP2xPP2 on 4 gloo ranks against transformers' Qwen2ForSequenceClassification
with the same weights: Bradley-Terry loss, every gradient, and the scores used in RL (also with
responses ending in an EOS token equal to the pad token)."""

from __future__ import annotations

import tests.distributed.reward_workers as w
from tests.assets import tiny_qwen2_reward_dir
from tests.mp import run_gloo


def test_bradley_terry_loss_grads_and_scores_equal_transformers_at_tp2_pp2():
    results = run_gloo(w.reward_model_worker, 4, str(tiny_qwen2_reward_dir()))
    last_stage = [r for r in results if "loss_diff" in r]
    assert len(last_stage) == 2  # the two TP ranks of the last stage
    assert all(r["micro_batches"] == 3 for r in results)  # 5 pairs, 2 per micro-batch
    for r in last_stage:
        assert r["loss_diff"] < 1e-5, r
        assert r["has_score_grad"] == 1.0  # the head's gradient is compared too
    for r in results:  # each stage compares the gradients of its own parameters
        assert r["grad_ref_max"] > 1e-4, r  # a real gradient, not zeros
        assert r["grad_diff"] < 1e-5, r
        assert r["score_diff"] < 1e-5, r  # every rank gets the scores
        assert r["eos_score_diff"] < 1e-5, r  # pad == EOS: scored where transformers reads
        assert r["at_eos_diff"] > 1e-3, r  # and that is not the EOS position
        assert r["bf16_dtypes"] == 1.0, r  # a bf16 model is bf16 throughout
