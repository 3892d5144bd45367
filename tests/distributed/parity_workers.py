"""Rank-side bodies of the model parity tests (imported by spawned gloo processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.models.build import ModelOptions, build_model
from megarl.models.distributed import OptimSettings, wrap_for_training
from megarl.models.export import iter_stage_hf_tensors
from megarl.models.forward import forward_logits, run_schedule
from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
from megarl.platform import adapt_megatron_for_cpu


def batch_for(dp_rank: int, vocab: int, batch: int = 2, seq: int = 13) -> torch.Tensor:
    """A random batch; the odd length makes sequence parallelism pad it (TP2 splits it evenly)."""
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _setup(world: int, spec: dict) -> tuple[ParallelLayout, ModelOptions, str]:
    """Layout and model options of a layout spec (``sequence_parallel`` and ``recompute`` are
    model options; unset, SP takes the default, on at tp > 1); the key names all three."""
    spec = dict(spec)
    opts = ModelOptions(
        sequence_parallel=spec.pop("sequence_parallel", None),
        recompute=spec.pop("recompute", "none"),
        recompute_num_layers=spec.pop("recompute_num_layers", 1),
    )
    layout = ParallelLayout.for_world(world, **spec)
    initialize_model_parallel(layout)
    sp = opts.sequence_parallel if opts.sequence_parallel is not None else layout.tp > 1
    key = str(layout) + ("+SP" if sp else "")
    if opts.recompute != "none":
        key += f"+{opts.recompute}{opts.recompute_num_layers}"
    return layout, opts, key


def logits_worker(rank: int, world: int, model_dir: str, layouts: list[dict]) -> dict[str, float]:
    """Max |megatron - HF| logits on each layout (reported by last-stage ranks only)."""
    adapt_megatron_for_cpu()
    from megatron.core import parallel_state as ps

    hf = _hf(model_dir)
    out: dict[str, float] = {}
    for spec in layouts:
        layout, opts, key = _setup(world, spec)
        model, dims = build_model(model_dir, layout, opts=opts)
        ids = batch_for(ps.get_data_parallel_rank(), dims.vocab_size)
        logits = forward_logits([model], ids)
        if logits is not None:
            with torch.no_grad():
                ref = hf(ids).logits
            diff = (logits - ref).abs().max().item()
            out[key] = max(diff, out.get(key, 0.0))
            out[key + ":rel"] = diff / ref.abs().max().item()
        if layout.tp > 1 and layout.pp > 1:
            out.update(_critic_and_reference(model_dir, layout, hf, ids, logits, opts))
        destroy_model_parallel()
    return out


def _critic_and_reference(model_dir, layout, hf, ids, actor_logits, opts) -> dict[str, float]:
    """Critic values = value head over HF's final hidden states; reference logits = actor's.
    The critic also scores chosen positions only (as the PPO update does)."""
    from megarl.models.forward import run_schedule

    critic, dims = build_model(model_dir, layout, role="critic", opts=opts)
    head = torch.Generator().manual_seed(7)
    w_head = torch.randn(1, dims.hidden_size, generator=head)
    b_head = torch.randn(1, generator=head)
    out: dict[str, float] = {}
    if hasattr(critic, "output_layer"):
        with torch.no_grad():
            critic.output_layer.weight.copy_(w_head)
            critic.output_layer.bias.copy_(b_head)
    values = run_schedule(
        [critic], [{"input_ids": ids}], lambda o, b: (o.sum() * 0, {"v": o}), forward_only=True
    )
    positions = torch.tensor([[3, 7, 12], [0, 5, 11]], device=ids.device)
    picked = run_schedule(
        [critic],
        [{"input_ids": ids, "positions": positions}],
        lambda o, b: (o.sum() * 0, {"v": o}),
        forward_only=True,
    )
    reference, _ = build_model(model_dir, layout, role="reference", opts=opts)
    out["reference_trainable_params"] = float(sum(p.requires_grad for p in reference.parameters()))
    out["reference_in_eval"] = float(not reference.training)
    ref_logits = forward_logits([reference], ids)
    if values:
        with torch.no_grad():
            hidden = hf(ids, output_hidden_states=True).hidden_states[-1]
        expected = hidden @ w_head.T + b_head
        # relative to the values' scale (the random head makes them O(10)), as the logits' :rel
        scale = expected.abs().max().item()
        out["critic:rel"] = (values[0]["v"] - expected).abs().max().item() / scale
        rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        picked_diff = (picked[0]["v"] - expected[rows, positions]).abs().max().item()
        out["critic_positions:rel"] = picked_diff / scale
        out["reference_vs_actor"] = (ref_logits - actor_logits).abs().max().item()
    return out


def _ce_loss(logits_shard: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
    from megatron.core import tensor_parallel

    ids = batch["input_ids"]
    targets = ids[:, 1:]
    per_token = tensor_parallel.vocab_parallel_cross_entropy(
        logits_shard[:, :-1].contiguous(), targets
    )
    return per_token.mean(), {"loss": per_token.mean().detach()}


def _reference_step(model_dir, world_dp: int, vocab: int, settings: OptimSettings):
    """HF model: loss = mean over DP ranks of each rank's token-mean CE; grads; the grads' total
    norm before clipping; one AdamW step."""
    hf = _hf(model_dir)
    hf.train()
    losses = []
    for dp in range(world_dp):
        ids = batch_for(dp, vocab)
        logits = hf(ids).logits
        losses.append(
            torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1)
            )
        )
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    decay = [p for n, p in hf.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in hf.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": settings.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=settings.lr,
        betas=(settings.adam_beta1, settings.adam_beta2),
        eps=settings.adam_eps,
        fused=True,  # transformers' Trainer default; megarl's optimizer runs the same kernel
    )
    norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), settings.clip_grad)  # before clipping
    opt.step()
    weights = {n: p.detach().clone() for n, p in hf.named_parameters()}
    # HF ties lm_head to embed_tokens: expose both names like the checkpoint does.
    return loss.item(), norm.item(), _saved_names(hf, grads), _saved_names(hf, weights)


def _saved_names(hf, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors under the names HF saves: transformers 5 keeps an MoE layer's experts fused in
    memory (``experts.gate_up_proj`` [E, 2I, H]) and splits them per expert on save; its own
    ``revert_weight_conversion`` does that here. Dense models are left as they are."""
    if not any(".experts." in name for name in tensors):
        return tensors
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(hf, tensors)


def _offload_round_trip(ddp, optimizer, dims, layout) -> float:
    """1.0 when moving the DDP model's and megatron optimizer's storage to the host and back
    released every storage and restored every weight, grad and Adam state bit for bit."""
    from megarl.models.offload import model_tensors, offload, onload

    tensors = model_tensors(ddp, optimizer)
    before = [t.detach().clone() for t in tensors]
    weights = {n: w.clone() for n, w in iter_stage_hf_tensors(ddp, dims, layout)}
    moved = offload(tensors)
    released = all(t.untyped_storage().nbytes() == 0 for t in tensors)
    onload(moved)
    exact = all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    exact = exact and all(
        torch.equal(w, weights[n]) for n, w in iter_stage_hf_tensors(ddp, dims, layout)
    )
    return float(released and exact and moved.bytes_moved > 0)


def train_step_worker(
    rank: int, world: int, model_dir: str, layouts: list[dict]
) -> dict[str, float]:
    """Grad and one-step parity of megatron DDP + distributed Adam against HF + torch AdamW."""
    adapt_megatron_for_cpu()
    from megatron.core import parallel_state as ps

    settings = OptimSettings(lr=1e-2, weight_decay=0.1, adam_eps=1e-3, clip_grad=0.5)
    out: dict[str, float] = {}
    grads_by_layout: dict[str, dict[str, torch.Tensor]] = {}
    for spec in layouts:
        layout, opts, key = _setup(world, spec)
        model, dims = build_model(model_dir, layout, opts=opts)
        ref_loss, ref_norm, ref_grads, ref_weights = _reference_step(
            model_dir, layout.dp, dims.vocab_size, settings
        )
        ddp, optimizer, _ = wrap_for_training(model, settings)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ids = batch_for(ps.get_data_parallel_rank(), dims.vocab_size)
        metrics = run_schedule([ddp], [{"input_ids": ids}], _ce_loss, forward_only=False)
        # The distributed optimizer reduce-scatters grads over DP: only with DP=1 does every
        # rank hold whole reduced grads to compare.
        grad_diff = 0.0
        if layout.dp == 1:
            grads = dict(iter_stage_hf_tensors(ddp, dims, layout, use_main_grad=True))
            grad_diff = max((g - ref_grads[name]).abs().max().item() for name, g in grads.items())
            grads_by_layout[key] = {name: g.clone() for name, g in grads.items()}
        ok, grad_norm, _ = optimizer.step()
        # The total norm before clipping, over every DP/TP/PP/EP shard: the check that reaches
        # DP > 1 and EP layouts, whose reduced grads no rank holds whole. A DP sum instead of a
        # mean scales it by DP; Adam's step after clipping (0.5 against a norm of ~4) would not
        # show a uniform scale error, the norm does.
        out[key + ":grad_norm"] = abs(grad_norm - ref_norm) / ref_norm
        out[key + ":offload_exact"] = _offload_round_trip(ddp, optimizer, dims, layout)
        diffs = {
            name: (w - ref_weights[name]).abs().max().item()
            for name, w in iter_stage_hf_tensors(ddp, dims, layout)
        }
        weight_diff = max(diffs.values())
        out[key + ":grad"] = grad_diff
        out[key + ":grad_checked"] = float(layout.dp == 1)
        out[key + ":weight"] = weight_diff
        out[key + ":step_ok"] = float(bool(ok))
        if metrics:
            loss = torch.stack([m["loss"] for m in metrics]).mean()
            dist.all_reduce(loss, group=ps.get_data_parallel_group())
            # relative to the loss (~log vocab): fp32 sums in another order, e.g. Qwen3's q/k norms
            out[key + ":loss"] = abs(loss.item() / layout.dp - ref_loss) / max(1.0, abs(ref_loss))
        destroy_model_parallel()
    sp, no_sp = grads_by_layout.get("TP2xPP2xDP1+SP"), grads_by_layout.get("TP2xPP2xDP1")
    if sp is not None and no_sp is not None:
        out["sp_vs_no_sp:grad"] = max((sp[n] - no_sp[n]).abs().max().item() for n in sp)
    return out


def logits_and_step_worker(
    rank: int, world: int, model_dir: str, layouts: list[dict]
) -> dict[str, float]:
    """Both checks in one launch: logits against HF, then one training step (MoE tests)."""
    out = logits_worker(rank, world, model_dir, layouts)
    out.update(train_step_worker(rank, world, model_dir, layouts))
    out.update(_router_losses(world, model_dir))
    return out


def _router_losses(world: int, model_dir: str, ep: int = 2) -> dict[str, float]:
    """With both router-loss coefficients set (EP2), one training step records the load-balancing
    loss and the z-loss, and megarl's metrics read them (``actor/moe_*``): reported as values."""
    from megatron.core import parallel_state as ps

    from megarl.models.moe_metrics import router_loss_metrics

    layout = ParallelLayout.for_world(world, ep=ep)
    initialize_model_parallel(layout)
    opts = ModelOptions(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    model, dims = build_model(model_dir, layout, opts=opts)
    ddp, optimizer, _ = wrap_for_training(model, OptimSettings(lr=1e-3))
    ids = batch_for(ps.get_data_parallel_rank(), dims.vocab_size)
    run_schedule([ddp], [{"input_ids": ids}] * 2, _ce_loss, forward_only=False)
    optimizer.step()
    metrics = router_loss_metrics("actor", 2, dims.num_layers)
    again = router_loss_metrics("actor", 2, dims.num_layers)  # cleared: zeros now
    destroy_model_parallel()
    return {"router:" + k.split("/", 1)[1]: v for k, v in metrics.items()} | {
        "router:cleared": float(all(v == 0.0 for v in again.values()))
    }
