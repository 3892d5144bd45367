"""Rank-side bodies of the LoRA parity tests against peft on transformers (spawned gloo ranks)."""

from __future__ import annotations

import torch

from megarl.models.build import build_model
from megarl.models.dims import layer_offset
from megarl.models.distributed import OptimSettings, wrap_for_training
from megarl.models.forward import forward_logits, run_schedule
from megarl.models.lora import LoraSettings, adapters_disabled, add_lora
from megarl.models.lora_peft import iter_stage_adapter_tensors, load_peft_adapters
from megarl.parallel import destroy_model_parallel
from megarl.platform import adapt_megatron_for_cpu
from tests.distributed.parity_workers import _ce_loss, _hf, _setup, batch_for

SETTINGS = LoraSettings(rank=4, alpha=8.0, target_modules=("all-linear",))


def peft_model(model_dir: str, settings: LoraSettings):
    """peft's LoRA model on transformers' model, every adapter matrix random (B too, so the
    adapters change the logits), seeded: every rank builds the same one."""
    from peft import LoraConfig, get_peft_model

    base = _hf(model_dir)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=0.0,
        target_modules="all-linear",
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def peft_tensors(model, grads: bool = False) -> dict[str, torch.Tensor]:
    """peft's adapter tensors (or their grads) under the names of its saved adapter files."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            value = p.grad if grads else p
            out[name.replace(".default.weight", ".weight")] = value.detach().clone()
    return out


def _peft_reference(model_dir: str, dp: int, vocab: int):
    """peft logits of each DP rank's batch, and adapter grads of the mean over DP ranks of each
    rank's token-mean cross-entropy."""
    model = peft_model(model_dir, SETTINGS)
    model.eval()
    logits, losses = {}, []
    for r in range(dp):
        ids = batch_for(r, vocab)
        out = model(ids).logits
        logits[r] = out.detach()
        losses.append(
            torch.nn.functional.cross_entropy(
                out[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1)
            )
        )
    torch.stack(losses).mean().backward()
    with torch.no_grad(), model.disable_adapter():
        base_logits = {r: model(batch_for(r, vocab)).logits for r in range(dp)}
    return model, logits, base_logits, peft_tensors(model, grads=True)


def lora_parity_worker(
    rank: int, world: int, model_dir: str, layouts: list[dict]
) -> dict[str, float]:
    """Per layout: max |megarl - peft| logits, adapter grads, base (adapters off) logits; the
    trainable parameters are exactly the adapters'."""
    adapt_megatron_for_cpu()
    from megatron.core import parallel_state as ps

    out: dict[str, float] = {}
    for spec in layouts:
        layout, opts, key = _setup(world, spec)
        model, dims = build_model(model_dir, layout, opts=opts)
        offset = layer_offset(dims, layout, ps.get_pipeline_model_parallel_rank())
        add_lora(model, dims, offset, SETTINGS)
        ref, ref_logits, ref_base, ref_grads = _peft_reference(
            model_dir, layout.dp, dims.vocab_size
        )
        load_peft_adapters(model, dims, layout, peft_tensors(ref))
        dp_rank = ps.get_data_parallel_rank()
        ids = batch_for(dp_rank, dims.vocab_size)
        logits = forward_logits([model], ids)
        with adapters_disabled(model):
            base = forward_logits([model], ids)
        if logits is not None:
            out[key + ":logits"] = (logits - ref_logits[dp_rank]).abs().max().item()
            out[key + ":base_logits"] = (base - ref_base[dp_rank]).abs().max().item()
            out[key + ":adapters_matter"] = (logits - base).abs().max().item()
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        out[key + ":only_adapters_trainable"] = float(
            bool(trainable) and all(".lora." in n for n in trainable)
        )
        ddp, _, _ = wrap_for_training(model, OptimSettings(use_distributed_optimizer=False))
        ddp.zero_grad_buffer()
        run_schedule([ddp], [{"input_ids": ids}], _ce_loss, forward_only=False)
        grads = dict(iter_stage_adapter_tensors(ddp, dims, layout, use_main_grad=True))
        out[key + ":grads"] = max((g - ref_grads[n]).abs().max().item() for n, g in grads.items())
        out[key + ":grad_scale"] = max(g.abs().max().item() for g in grads.values())
        out[key + ":adapter_tensors"] = float(len(grads))
        destroy_model_parallel()
    return out


def _dp_sum(value: float) -> float:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return t.item()


def lora_roles_worker(rank: int, world: int, model_dir: str, spec: dict) -> dict[str, float]:
    """The run's models with ``actor.lora`` on (GRPO with a KL loss): no reference model is
    built, the reference logprobs come from the actor's base, and the distributed optimizer
    holds the adapters alone (parameters and Adam state bytes, summed over the DP shards)."""
    adapt_megatron_for_cpu()
    from megatron.core import parallel_state as ps

    from megarl.config import load_config
    from megarl.models.lora import adapters
    from megarl.trainer.assembly import role_sections
    from megarl.trainer.roles import build_roles
    from tests.policy_terms import algorithm_spec

    layout, _, key = _setup(world, spec)
    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "data.train_files=[unused.parquet]",
            "algorithm.use_kl_loss=true",
            "actor.lora.rank=4",
            "actor.lora.alpha=8",
            f"parallel.tp={layout.tp}",
            f"parallel.pp={layout.pp}",
        ],
    )
    from megarl.models.dims import ModelDims

    dims = ModelDims.from_pretrained(model_dir)
    roles = build_roles(role_sections(cfg), layout, algorithm_spec(cfg, dims.vocab_size))
    actor = roles.actor
    adapter_numel = sum(
        p.numel() for _, a in adapters(actor.model) for p in a.parameters()
    )  # this rank's shards
    stage_numel = sum(p.numel() for p in actor.model.parameters())
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    # megatron chains one distributed optimizer per parameter group; each wraps a torch Adam
    # over this DP rank's shard of its parameters
    chained = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    in_optimizer, state_bytes = 0, 0
    for opt in chained:
        opt._init_optimizer_states_with_dummy_values()
        inner = opt.optimizer
        in_optimizer += sum(p.numel() for g in inner.param_groups for p in g["params"])
        state_bytes += sum(
            t.numel() * t.element_size()
            for s in inner.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
    ids = batch_for(ps.get_data_parallel_rank(), dims.vocab_size)
    with roles.reference_model() as ref:
        ref_logits = forward_logits([ref], ids)
    out = {
        f"{key}:reference_built": float(roles.reference is not None),
        f"{key}:has_reference": float(roles.has_reference),
        f"{key}:trainable_is_adapters": float(trainable == adapter_numel > 0),
        f"{key}:adapter_share": adapter_numel / stage_numel,
        # the DP shards of the distributed optimizer together hold every adapter element once
        f"{key}:optimizer_params_over_adapters": _dp_sum(in_optimizer) / adapter_numel,
        # Adam's two fp32 moments per adapter element, nothing for the frozen base
        f"{key}:adam_bytes_over_adapters": _dp_sum(state_bytes) / (8 * adapter_numel),
    }
    if ref_logits is not None:
        base = _hf(model_dir)
        with torch.no_grad():
            out[f"{key}:reference_vs_base"] = (ref_logits - base(ids).logits).abs().max().item()
    destroy_model_parallel()
    return out


def lora_checks_worker(
    rank: int, world: int, model_dir: str, layouts: list[dict], roles_layout: dict
) -> dict[str, float]:
    """Both checks in one launch: peft parity on ``layouts``, the run's models on
    ``roles_layout``."""
    out = lora_parity_worker(rank, world, model_dir, layouts)
    out.update(lora_roles_worker(rank, world, model_dir, roles_layout))
    return out
