"""bf16 on CPU against transformers, SmolLM2-135M-Instruct (real weights), one process.

- Logits: megarl in bf16 against transformers in bf16, both against transformers in fp32 (the
  reference). Bound: megarl's bf16 error is at most 1.5x transformers' own bf16 error + 0.05
  (two bf16 implementations round in different places; neither is the reference).
- Training step: megarl in bf16 (bf16 params, fp32 main weights and Adam states in megatron's
  distributed optimizer) against transformers in fp32 + torch AdamW on the same batch: the loss
  within 1% and the gradient norm within 5% of fp32's.
"""

from __future__ import annotations

import torch

from megarl.tools.testing.assets import smollm2_dir
from tests.mp import run_gloo


def worker(rank: int, world: int, model_dir: str) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from megarl.models.build import ModelOptions, build_model
    from megarl.models.distributed import OptimSettings, wrap_for_training
    from megarl.models.forward import forward_logits, run_schedule
    from megarl.parallel import ParallelLayout, initialize_model_parallel
    from megarl.platform import adapt_megatron_for_cpu

    adapt_megatron_for_cpu()
    initialize_model_parallel(ParallelLayout())
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.no_grad():
        ref32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ref = ref32(ids).logits.float()
        hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        out["hf_bf16_err"] = (hf16(ids).logits.float() - ref).abs().max().item()
    model, _ = build_model(model_dir, ParallelLayout(), opts=ModelOptions(dtype=torch.bfloat16))
    logits = forward_logits([model], ids)
    out["megarl_bf16_err"] = (logits.float() - ref).abs().max().item()
    out["logit_scale"] = ref.abs().max().item()

    # One training step: fp32 reference (transformers + torch AdamW) vs megarl bf16.
    ref32.train()
    loss32 = torch.nn.functional.cross_entropy(
        ref32(ids).logits[:, :-1].reshape(-1, 49152), ids[:, 1:].reshape(-1)
    )
    loss32.backward()
    out["fp32_loss"] = loss32.item()
    out["fp32_grad_norm"] = torch.nn.utils.clip_grad_norm_(ref32.parameters(), 1e9).item()

    ddp, optimizer, _ = wrap_for_training(model, OptimSettings(lr=1e-5, clip_grad=1e9))
    out["main_params_fp32"] = float(
        all(
            p.dtype == torch.float32
            for group in optimizer.optimizer.param_groups
            for p in group["params"]
        )
    )

    def loss_fn(logits, batch):
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        loss = -logp.gather(-1, ids[:, 1:, None]).mean()
        return loss, {"loss": loss.detach()}

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = run_schedule([ddp], [{"input_ids": ids}], loss_fn, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    out["bf16_loss"] = metrics[0]["loss"].item()
    out["bf16_grad_norm"] = float(grad_norm)
    out["bf16_step_ok"] = float(bool(ok))
    out["params_bf16"] = float(all(p.dtype == torch.bfloat16 for p in ddp.module.parameters()))
    return out


def test_bf16_logits_and_step_against_transformers():
    (out,) = run_gloo(worker, 1, str(smollm2_dir()))
    print(out)
    assert out["megarl_bf16_err"] <= 1.5 * out["hf_bf16_err"] + 0.05, out
    assert out["params_bf16"] == 1.0 and out["main_params_fp32"] == 1.0, out
    assert out["bf16_step_ok"] == 1.0, out
    assert abs(out["bf16_loss"] - out["fp32_loss"]) <= 0.01 * out["fp32_loss"], out
    assert abs(out["bf16_grad_norm"] - out["fp32_grad_norm"]) <= 0.05 * out["fp32_grad_norm"], out
