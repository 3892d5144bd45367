"""Rank-side body of the routing-replay test (imported by spawned gloo processes)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megarl.models.build import build_model
from megarl.models.forward import ROUTING_FLAGS, gather_vocab, run_schedule
from megarl.models.router_replay import moe_layer_index, replay_routers, routers, routing_counts
from megarl.parallel import destroy_model_parallel
from megarl.platform import adapt_megatron_for_cpu
from megarl.trainer.routing_flags import (
    AGREED,
    FLIPPED,
    combine_over_model_parallel,
    position_codes,
)
from tests.distributed.parity_workers import _hf, _setup, batch_for


def _hf_routers(hf) -> list[torch.nn.Module]:
    return [m for m in hf.modules() if type(m).__name__.endswith("TopKRouter")]


def natural_routes(hf, ids: torch.Tensor) -> torch.Tensor:
    """``[b, s, layers, k]`` the experts transformers' routers choose for ``ids``."""
    seen: list[torch.Tensor] = []
    hooks = [
        r.register_forward_hook(lambda _m, _a, out: seen.append(out[2].detach()))
        for r in _hf_routers(hf)
    ]
    with torch.no_grad():
        hf(ids)
    for h in hooks:
        h.remove()
    b, s = ids.shape
    return torch.stack([x.reshape(b, s, -1) for x in seen], dim=2).to(torch.int16)


@contextmanager
def forced(hf, routes: torch.Tensor) -> Iterator[None]:
    """Inside the block, transformers' routers use ``routes`` (``[b, s, layers, k]``; -1: their
    own choice), their weights the softmax probabilities of those experts (renormalised where
    the config says so): an MoE forward "forced onto the same experts", written here."""
    originals = []
    for layer, router in enumerate(_hf_routers(hf)):
        want = routes[:, :, layer].reshape(-1, routes.shape[-1]).long()

        def forward(hidden, router=router, want=want):
            hidden = hidden.reshape(-1, router.hidden_dim)
            logits = torch.nn.functional.linear(hidden, router.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            _, own = torch.topk(probs, router.top_k, dim=-1)
            idx = torch.where(want[:, :1] >= 0, want, own)
            top = probs.gather(1, idx)
            if getattr(router, "norm_topk_prob", True):
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        originals.append((router, router.forward))
        router.forward = forward
    try:
        yield
    finally:
        for router, original in originals:
            router.forward = original


def random_routes(b: int, s: int, layers: int, experts: int, k: int, seed: int) -> torch.Tensor:
    """Top-k sets drawn at random per token and layer (distinct experts), the last token -1."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(b, s, layers, experts, generator=gen)
    routes = scores.topk(k, dim=-1).indices.to(torch.int16)
    routes[:, -1] = -1
    return routes


def perturb(weight: torch.Tensor, layer: int) -> None:
    """A router's weight moved at random, drawn per global layer (the same on any stage)."""
    gen = torch.Generator().manual_seed(5 + layer)
    weight.add_(torch.randn(weight.shape, generator=gen) * 0.3 * weight.std())


def _logits(
    model, ids: torch.Tensor, routes: torch.Tensor | None, packed: bool, seen=None, shared=None
):
    """The full-vocabulary logits (last stage; else None); ``seen`` gets the micro-batch's dict;
    ``shared`` (prompt and sequence lengths) runs the rows as a shared-prompt pack."""
    batch: dict = {"input_ids": ids}
    if seen is not None:
        seen.append(batch)
    if routes is not None:
        batch["routes"] = routes
    if packed:
        batch["seq_lens"] = torch.full((ids.shape[0],), ids.shape[1])
    if shared is not None:
        batch["prompt_lens"], batch["seq_lens"] = shared
    out = run_schedule(
        [model],
        [batch],
        lambda o, b: (o.sum() * 0.0, {"logits": gather_vocab(o)}),
        forward_only=True,
    )
    return out[0]["logits"] if out else None


def replay_worker(rank: int, world: int, model_dir: str, layouts: list[dict]) -> dict[str, float]:
    """Per layout, max |megatron - transformers| logits: forced onto random experts (replayed,
    padded and packed); on transformers' own routing with the trainer's routers perturbed,
    without and with replay; and the routing agreement counts of each (last stage reports)."""
    adapt_megatron_for_cpu()
    from megatron.core import parallel_state as ps

    hf = _hf(model_dir)
    out: dict[str, float] = {}
    for spec in layouts:
        layout, opts, key = _setup(world, spec)
        model, dims = build_model(model_dir, layout, opts=opts)
        ids = batch_for(ps.get_data_parallel_rank(), dims.vocab_size)
        b, s = ids.shape
        layers = len(_hf_routers(hf))
        # the ranks of one TP group hold the same rows (one DP rank): the same routes
        routes = random_routes(
            b, s, layers, dims.num_experts, dims.moe_topk, seed=70 + ps.get_data_parallel_rank()
        )
        with torch.no_grad(), forced(hf, routes):
            ref_forced = hf(ids).logits
        with torch.no_grad():
            ref_natural = hf(ids).logits
        natural = natural_routes(hf, ids)
        replay_routers(model, replay=True)
        results = {}
        for name, packed in (("padded", False), ("packed", True)):
            logits = _logits(model, ids, routes, packed)
            counts = routing_counts(model)
            if logits is not None:
                results[f"forced_{name}"] = (logits - ref_forced).abs().max().item()
                logp, ref_logp = logits.log_softmax(-1), ref_forced.log_softmax(-1)
                results[f"forced_{name}_logprob"] = (logp - ref_logp).abs().max().item()
            out[f"{key}:forced_{name}_used"] = counts.used_agrees / max(counts.tokens, 1)
        logits = _logits(model, ids, None, False)  # no routes: the routers' own choice
        if logits is not None:
            results["own"] = (logits - ref_natural).abs().max().item()
        # the trainer's routers perturbed: a rollout (transformers) that routed otherwise
        unperturbed = {id(r): r.weight.detach().clone() for r in routers(model)}
        with torch.no_grad():
            for router in routers(model):
                perturb(router.weight, moe_layer_index(router, model))
        for name, replay in (("perturbed", False), ("perturbed_replayed", True)):
            replay_routers(model, replay=replay)
            seen: list[dict] = []
            logits = _logits(model, ids, natural, False, seen)
            counts = routing_counts(model)
            if not replay:  # each token flipped or agreed, every stage's and SP share's layers
                flags = combine_over_model_parallel(position_codes(seen[0][ROUTING_FLAGS], (b, s)))
                expected = _flipped_by(hf, ids, natural)
                out[f"{key}:flag_errors"] = float((flags != expected).sum())
                out[f"{key}:flipped_tokens"] = float((flags == FLIPPED).float().mean())
            if logits is not None:
                results[name] = (logits - ref_natural).abs().max().item()
            out[f"{key}:{name}_router"] = counts.router_agrees / max(counts.tokens, 1)
            out[f"{key}:{name}_used"] = counts.used_agrees / max(counts.tokens, 1)
        results.update(_shared_prompt_pack(hf, model, dims, key, out, unperturbed))
        for name, value in results.items():
            out[f"{key}:{name}"] = max(value, out.get(f"{key}:{name}", 0.0))
        destroy_model_parallel()
    return out


def _shared_prompt_pack(
    hf, model, dims, key: str, out: dict[str, float], unperturbed: dict[int, torch.Tensor]
) -> dict[str, float]:
    """The same as a shared-prompt pack (actor.share_prompts): rows 0 and 1 share a 6-token
    prompt (and, as one engine batch routes them, its experts), row 2 has its own 4-token one;
    the rows end at 13, 10 and 12 tokens. Forced onto random experts, the logits at every real
    position equal transformers' forced forward of each row alone; with the trainer's routers
    perturbed (the state the caller left), each token's flag, row 1's prompt included (its
    tokens ran once, as row 0's), equals transformers'. Returns the logit figures."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_rank()
    ids = batch_for(dp, dims.vocab_size, batch=3)
    ids[1, :6] = ids[0, :6]
    prompt_lens, seq_lens = torch.tensor([6, 6, 4]), torch.tensor([13, 10, 12])
    real = torch.arange(ids.shape[1]).unsqueeze(0) < seq_lens.unsqueeze(1)
    layers = len(_hf_routers(hf))
    routes = random_routes(3, ids.shape[1], layers, dims.num_experts, dims.moe_topk, 90 + dp)
    routes[1, :6] = routes[0, :6]
    results = {}
    perturbed = {id(r): r.weight.detach().clone() for r in routers(model)}
    with torch.no_grad():  # the forced comparison on the unperturbed routers
        for router in routers(model):
            router.weight.copy_(unperturbed[id(router)])
        with forced(hf, routes):
            reference = hf(ids).logits
    replay_routers(model, replay=True)
    logits = _logits(model, ids, routes, False, shared=(prompt_lens, seq_lens))
    counts = routing_counts(model)
    if logits is not None:
        results["forced_shared"] = (logits - reference)[real].abs().max().item()
        diff = logits.log_softmax(-1) - reference.log_softmax(-1)
        results["forced_shared_logprob"] = diff[real].abs().max().item()
    out[f"{key}:forced_shared_used"] = counts.used_agrees / max(counts.tokens, 1)
    with torch.no_grad():
        for router in routers(model):
            router.weight.copy_(perturbed[id(router)])
    replay_routers(model, replay=False)
    natural = natural_routes(hf, ids)
    seen: list[dict] = []
    _logits(model, ids, natural, False, seen, shared=(prompt_lens, seq_lens))
    routing_counts(model)
    flags = combine_over_model_parallel(position_codes(seen[0][ROUTING_FLAGS], tuple(ids.shape)))
    expected = _flipped_by(hf, ids, natural)
    out[f"{key}:shared_flag_errors"] = float((flags != expected)[real].sum())
    out[f"{key}:shared_unflagged"] = float((flags[real] == 0).sum())  # real tokens unmarked
    return results


def _flipped_by(hf, ids: torch.Tensor, natural: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` per token: FLIPPED where transformers' routers, perturbed as the trainer's
    are, choose another expert set than ``natural`` at some layer; else AGREED."""
    moved = copy.deepcopy(hf)
    with torch.no_grad():
        for layer, router in enumerate(_hf_routers(moved)):
            perturb(router.weight, layer)
    own = natural_routes(moved, ids).long().sort(dim=-1).values
    differs = (own != natural.long().sort(dim=-1).values).any(dim=-1).any(dim=-1)
    return torch.where(differs, FLIPPED, AGREED).to(torch.int32)
