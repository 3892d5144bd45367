"""Dr. GRPO (``seq-mean-token-sum-norm``) through megatron DDP + the distributed optimizer: one
actor update of the same 16 sequences (responses of 1-12 tokens) gives the same loss, gradient
norm and updated weights at DP2 and at TP2 (DP1), with 1, 3, 5 or 16 sequences per micro-batch.

Each sequence's token sum is divided by one constant (rollout.sampling.max_response_length), so neither
the micro-batch's padded width nor a rank's share of the tokens enters the loss. Tolerances
(fp32, sums in another order): loss and grad norm 1e-5 relative, weights 1e-6 absolute after
one Adam step of lr 1e-2.
"""

from __future__ import annotations

import pytest

from tests.assets import tiny_qwen2_dir
from tests.distributed.dr_grpo_workers import dr_grpo_worker
from tests.mp import run_gloo

CASES = [
    dict(tp=1, micro=1),  # DP2: 8 sequences per rank
    dict(tp=1, micro=3),
    dict(tp=2, micro=16),  # DP1: the whole batch in one micro-batch
    dict(tp=2, micro=5),
]


def test_dr_grpo_update_is_the_same_for_any_dp_split_and_micro_batching():
    results = run_gloo(dr_grpo_worker, 2, str(tiny_qwen2_dir()), CASES)
    runs = results[0]  # every rank reports the global loss, norm and full weights
    print(runs)  # the measured figures, for the log
    assert len(runs) == len(CASES), list(runs)
    (ref_key, ref), *others = runs.items()
    assert ref["pg_loss"] != 0.0 and ref["grad_norm"] > 0.0
    for key, run in runs.items():
        assert run["moved"] > 1e-3, key  # the update moved the weights (lr 1e-2)
        assert run["same_names"] == 1.0, key
        assert results[1][key]["grad_norm"] == run["grad_norm"], key  # rank 1 saw the same
    for key, run in others:
        assert run["pg_loss"] == pytest.approx(ref["pg_loss"], rel=1e-5), (key, ref_key)
        assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (key, ref_key)
        for rank in (0, 1):
            assert results[rank][key]["weights_vs_first"] < 1e-6, (rank, key, ref_key)
