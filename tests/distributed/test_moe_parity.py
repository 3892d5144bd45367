"""Mixture-of-experts models (Qwen3-MoE, Mixtral) built by megarl equal Hugging Face transformers.

One 4-rank gloo launch per family checks, on the tiny random models (4 experts, top-2):
- logits against transformers (fp32, max abs <= 1e-5) at EP2 (TP1xDP4), TP2xEP2 (expert tensor
  parallel = TP = 2, sequence parallel), PP2xEP2, and TP2xPP2 (EP1; with the critic and the
  frozen reference on the MoE trunk);
- one training step (megatron DDP + distributed Adam, router losses off) against transformers +
  torch AdamW: loss (relative) and the updated weights within 1e-6 at the same layouts, and the
  gradients themselves at TP2xPP2 (DP1: each rank holds whole reduced grads).
Both routers are covered: Qwen3-MoE's tiny config does not renormalise the top-k
probabilities, Mixtral does. Last, with the router-loss coefficients set, a training step's
load-balancing loss and z-loss reach megarl's metrics.
"""

from __future__ import annotations

import pytest

from tests.assets import tiny_mixtral_dir, tiny_qwen3_moe_dir
from tests.distributed import parity_workers as w
from tests.mp import run_gloo

pytestmark = pytest.mark.distributed

LAYOUTS = [dict(ep=2), dict(tp=2, ep=2), dict(pp=2, ep=2), dict(tp=2, pp=2)]
KEYS = ["TP1xPP1xDP4xEP2", "TP2xPP1xDP2xEP2+SP", "TP1xPP2xDP2xEP2", "TP2xPP2xDP1+SP"]
TINY = {"qwen3_moe": tiny_qwen3_moe_dir, "mixtral": tiny_mixtral_dir}


@pytest.mark.parametrize("model", ["qwen3_moe", "mixtral"])
def test_moe_logits_and_one_step_equal_transformers(model):
    results = run_gloo(w.logits_and_step_worker, 4, str(TINY[model]()), LAYOUTS)
    merged: dict[str, float] = {}
    for r in results:
        for k, v in r.items():
            merged[k] = max(v, merged.get(k, 0.0))
    print(model, merged)  # the measured figures, for the log
    for key in KEYS:
        assert merged[key] < 1e-5, (model, key, merged[key])
        assert merged[f"{key}:step_ok"] == 1.0, key
        assert merged[f"{key}:loss"] < 1e-6, (model, key, merged)
        # relative, before clipping, every expert shard counted once (EP2 layouts included)
        assert merged[f"{key}:grad_norm"] < 1e-5, (model, key, merged)
        assert merged[f"{key}:weight"] < 1e-6, (model, key, merged)
    assert merged["TP2xPP2xDP1+SP:grad_checked"] > 0.0
    assert merged["TP2xPP2xDP1+SP:grad"] < 1e-6, merged
    assert merged["critic:rel"] < 1e-5 and merged["reference_vs_actor"] == 0.0, merged
    # Router losses (coefficients set, EP2): recorded, read as metrics, cleared after reading.
    # The switch load-balancing loss is 1 for perfectly balanced routing and at most E/k = 2
    # here; the z-loss (mean squared logsumexp of the router logits) is positive.
    assert 0.5 < merged["router:moe_load_balancing_loss"] <= 2.0, merged
    assert merged["router:moe_z_loss"] > 0.0, merged
    assert min(r["router:cleared"] for r in results) == 1.0
