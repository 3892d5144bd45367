"""Skipping the separate old-logprob forward (``actor.old_log_prob_forward=auto``) when a batch
gets exactly one optimizer step: the step is the same as with the separate forward, and the
rollout mismatch metrics, measured on the update's forward instead, are the same.

One actor update (PPO clip, token-mean, sampling temperature 0.7) of the same 16 sequences at PP2
and at DP2 over 2 gloo ranks, micro-batches of 3 packed sequences, the old logprobs once from a
separate forward-only pass over the batch as one pack (as the hybrid engine scores a rollout),
once from the update's own forward. Tolerances (fp32, the same numbers from two forwards of
different batch shapes): old logprobs 1e-5, loss and grad norm 1e-5 relative, weights 1e-6
after one Adam step of lr 1e-2 that moves them by > 1e-3, mismatch metrics 1e-5.
"""

from __future__ import annotations

import pytest

from tests.assets import tiny_char_llama_dir
from tests.distributed.old_log_prob_workers import old_log_prob_worker
from tests.mp import run_gloo


def test_one_step_with_the_update_logprobs_equals_one_with_a_separate_forward():
    results = run_gloo(old_log_prob_worker, 2, str(tiny_char_llama_dir()), [2, 1])
    print({k: {n: v for n, v in r.items()} for k, r in results[0].items()})
    assert len(results[0]) == 2, list(results[0])  # PP2 and DP2
    for rank, runs in enumerate(results):
        for layout, r in runs.items():
            where = (rank, layout)
            assert r["from_update"] == (False, True), where
            assert r["same_start"] == 0.0, where
            assert r["old_diff"] < 1e-5, where
            norm_sep, norm_upd = r["grad_norm"]
            assert norm_sep > 0.0 and norm_upd == pytest.approx(norm_sep, rel=1e-5), where
            last_stage = "xPP1x" in layout or rank == 1  # where the loss's metrics live
            assert (r["pg_loss"][0] is not None) == last_stage, where
            if last_stage:
                (loss_sep, loss_upd), (ratio_sep, ratio_upd) = r["pg_loss"], r["ratio_max"]
                assert loss_sep != 0.0, where
                assert loss_upd == pytest.approx(loss_sep, rel=1e-5, abs=1e-7), where
                # ratio 1 (exactly, with the update's own logprobs) in every micro-batch,
                # combined over micro-batches the same way in both runs
                assert ratio_upd == pytest.approx(ratio_sep, abs=1e-5), where
            assert r["moved"] > 1e-3, where
            assert r["weights_diff"] < 1e-6, where
            separate, from_update = r["mismatch"]
            assert set(separate) == set(from_update), where
            assert separate["rollout/logprob_diff_mean"] > 1e-3, where  # the noise is seen
            for key, value in separate.items():
                assert from_update[key] == pytest.approx(value, abs=1e-5), (where, key)
