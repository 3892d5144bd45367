"""Routing replay (actor.router_replay) in megatron's routers, against transformers: one 4-rank
gloo launch on the tiny Qwen3-MoE (4 experts, top-2) at TP2 x DP2 x EP2 (sequence parallel),
EP2 (TP1 x DP4) and PP2 x EP2 (each stage's routers take their own layers' routes).

- Forced onto experts drawn at random (not the routers' choice), megarl's logits equal a
  transformers forward forced onto the same experts (written in the test), padded and packed:
  the recorded routes reach the right router, token and layer, across the SP split and EP.
  Measured: logprobs within 1.4e-6 (fp32), logits within 9.5e-7, where the same model's own
  routing is 7e-7 from transformers: replay adds no error.
- The trainer's routers perturbed (a rollout that routed otherwise, like a bf16 engine): without
  replay their choice disagrees with transformers' on part of the tokens and the logits move
  away; replaying transformers' routing, every token uses its experts again and the logits come
  back (the remaining gap is the perturbed gate weights of the same experts). Measured: the
  routers agree on 0.75-0.80 of token-layers, the logits move 0.076-0.087 away and 0.025 when
  replayed. Each token's
  flag for the mismatch split (megarl.trainer.routing_flags: flipped where some layer's router
  chose otherwise, combined over the pipeline stages and the sequence-parallel shares) equals
  the flag of transformers with the same perturbed routers.
"""

from __future__ import annotations

import pytest

from tests.assets import tiny_qwen3_moe_dir
from tests.distributed.router_replay_workers import replay_worker
from tests.mp import run_gloo

pytestmark = pytest.mark.distributed

LAYOUTS = [dict(tp=2, ep=2), dict(ep=2), dict(pp=2, ep=2)]
KEYS = ["TP2xPP1xDP2xEP2+SP", "TP1xPP1xDP4xEP2", "TP1xPP2xDP2xEP2"]


def test_replayed_routing_equals_a_forced_transformers_forward():
    results = run_gloo(replay_worker, 4, str(tiny_qwen3_moe_dir()), LAYOUTS)
    merged: dict[str, float] = {}
    for r in results:
        for k, v in r.items():
            merged[k] = (
                max(v, merged.get(k, 0.0))
                if "used" not in k and "router" not in k
                else min(v, merged.get(k, 1.0))
            )
    print(merged)  # the measured figures, for the log
    for key in KEYS:
        assert merged[f"{key}:own"] < 1e-5, merged
        for packing in ("padded", "packed"):
            assert merged[f"{key}:forced_{packing}"] < 1e-5, (key, packing, merged)
            assert merged[f"{key}:forced_{packing}_logprob"] < 5e-6, (key, packing, merged)
            assert merged[f"{key}:forced_{packing}_used"] == 1.0, merged
        # without replay the perturbed routers disagree on some tokens, and the logits move
        assert 0.0 < merged[f"{key}:perturbed_router"] < 1.0, merged
        assert merged[f"{key}:perturbed_used"] == merged[f"{key}:perturbed_router"]
        # replayed: every recorded token on transformers' experts, and the logits closer
        assert merged[f"{key}:perturbed_replayed_used"] == 1.0, merged
        assert merged[f"{key}:perturbed_replayed"] < merged[f"{key}:perturbed"] / 2, merged
        # a shared-prompt pack: forced, and each token's flag, row 1's shared prompt included
        assert merged[f"{key}:forced_shared"] < 1e-5, (key, merged)
        assert merged[f"{key}:forced_shared_logprob"] < 5e-6, (key, merged)
        assert merged[f"{key}:forced_shared_used"] == 1.0, merged
        assert merged[f"{key}:shared_flag_errors"] == 0, merged
        assert merged[f"{key}:shared_unflagged"] == 0, merged
        # every token's flag is transformers' (both kinds present)
        assert merged[f"{key}:flag_errors"] == 0, merged
        assert 0.0 < merged[f"{key}:flipped_tokens"] < 1.0, merged
