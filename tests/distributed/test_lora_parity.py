"""LoRA adapters on megatron's parallel linears equal peft's LoRA on transformers.

Same base weights, same (random) adapter weights: logits within 1e-5 and adapter gradients within
1e-6 (fp32) at TP1 (DP4), TP2 (DP2, with and without sequence parallelism) and TP2xPP2 (sequence parallel), all in
one launch of 4 gloo ranks; with the adapters disabled the logits are the base model's. The same
launch builds a LoRA run's models and checks what trains and what the optimizer holds.
"""

from __future__ import annotations

from tests.assets import tiny_qwen2_dir
from tests.distributed import lora_workers as w
from tests.mp import run_gloo

LAYOUTS = [dict(tp=1), dict(tp=2), dict(tp=2, sequence_parallel=False), dict(tp=2, pp=2)]
KEYS = ["TP1xPP1xDP4", "TP2xPP1xDP2+SP", "TP2xPP1xDP2", "TP2xPP2xDP1+SP"]


def test_lora_logits_and_grads_equal_peft():
    results = run_gloo(w.lora_checks_worker, 4, str(tiny_qwen2_dir()), LAYOUTS, dict(pp=2))
    merged: dict[str, float] = {}
    for r in results:
        for k, v in r.items():
            merged[k] = max(v, merged.get(k, 0.0))
    print(merged)  # the measured figures, for the log
    for key in KEYS:
        assert merged[key + ":logits"] <= 1e-5, (key, merged)
        assert merged[key + ":base_logits"] <= 1e-5, (key, merged)
        # the random adapters move the logits far more than the tolerance, so the check bites
        assert merged[key + ":adapters_matter"] > 1e-2, (key, merged)
        assert merged[key + ":grads"] <= 1e-6, (key, merged)
        assert merged[key + ":grad_scale"] > 1e-4, (key, merged)
        assert merged[key + ":only_adapters_trainable"] == 1.0, (key, merged)
    # The run's models with actor.lora on, GRPO with a KL loss, at TP1xPP2xDP2: no reference
    # model, the reference logprobs are the base model's, only the adapters train and fill the
    # distributed optimizer (its DP shards together: each adapter element once, Adam's two fp32
    # moments per element).
    run = "TP1xPP2xDP2"
    assert merged[f"{run}:reference_built"] == 0.0 and merged[f"{run}:has_reference"] == 1.0
    assert merged[f"{run}:reference_vs_base"] <= 1e-5, merged
    assert merged[f"{run}:trainable_is_adapters"] == 1.0, merged
    assert merged[f"{run}:optimizer_params_over_adapters"] == 1.0, merged
    assert merged[f"{run}:adam_bytes_over_adapters"] == 1.0, merged
