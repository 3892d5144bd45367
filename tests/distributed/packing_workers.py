"""Rank-side body of the packing parity test: every RL forward and backward, padded and packed, on
the same weights and the same batch of very unequal lengths (imported by spawned processes)."""

from __future__ import annotations

import torch

from megarl.config import RunConfig
from megarl.models.build import ModelOptions, build_model
from megarl.models.distributed import OptimSettings, wrap_for_training
from megarl.models.export import iter_stage_hf_tensors
from megarl.models.forward import run_schedule
from megarl.models.logprobs import teacher_forced_log_probs
from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
from megarl.platform import adapt_megatron_for_cpu
from megarl.rewards.model import score_sequences
from megarl.trainer.batch import Samples
from megarl.trainer.model_ops import (
    MicroBatching,
    forward_response_tensor,
    response_log_probs,
    response_positions,
    response_values,
)
from tests.policy_terms import algorithm_spec

# Very unequal: a 1-token response beside a 57-token one (padding is most of the padded batch).
PROMPT_LENS = [4, 2, 7, 3, 5]
RESPONSE_LENS = [1, 57, 3, 30, 12]


def unequal_samples(vocab: int) -> Samples:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    responses = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in RESPONSE_LENS]
    samples = Samples.from_sequences(prompts, responses, list(range(len(prompts))), 0, "cpu")
    shape = samples.response_mask.shape
    samples.tensors.advantages = torch.randn(shape, generator=gen)
    samples.tensors.ref_log_prob = -torch.rand(shape, generator=gen) * 8
    return samples


def _hf_log_probs(model_dir: str, samples: Samples) -> list[torch.Tensor]:
    """Each sample's response logprobs from transformers, one unpadded sequence at a time."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for i in range(samples.size):
            p, r = int(samples.prompt_lens[i]), int(samples.response_lens[i])
            ids = samples.input_ids[i : i + 1, : p + r]
            logp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
            out.append(logp[p - 1 : p + r - 1].gather(1, ids[0, p:].unsqueeze(1))[:, 0])
    return out


def _masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


def _masked_rel(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Max |a - b| / max(1, |a|): logprobs near -10 are spaced 9.5e-7 apart in fp32."""
    return float(((a - b).abs() / a.abs().clamp(min=1.0) * mask).max())


@torch.no_grad()
def _random_head(model) -> None:
    """A seeded random scalar head (a critic from a causal LM starts at zeros: all values 0)."""
    layer = getattr(model, "output_layer", None)
    if layer is not None:
        gen = torch.Generator().manual_seed(3)
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.1)


def _actor_step(ddp, dims, layout, samples: Samples, batching: MicroBatching):
    """The actor loss (PPO clip + KL loss, token-mean over the batch) and its grads per HF name."""
    cfg = RunConfig()
    loss_fn = algorithm_spec(cfg, dims.vocab_size).actor_loss
    mbs = batching.split(samples, range(samples.size))
    total = float(samples.response_mask.sum())

    def scaled(out, batch):
        loss, _ = loss_fn(out, batch["mb"])
        return loss * batch["weight"], {"loss": loss.detach() * batch["weight"]}

    inputs = [
        {**batching.inputs(mb), "weight": float(mb.response_mask.sum()) / total} for _, mb in mbs
    ]
    ddp.zero_grad_buffer()
    outs = run_schedule([ddp], inputs, scaled, forward_only=False)
    loss = float(torch.stack([o["loss"] for o in outs]).sum()) if outs else 0.0
    grads = {n: g.clone() for n, g in iter_stage_hf_tensors(ddp, dims, layout, use_main_grad=True)}
    return loss, grads


def packing_worker(rank: int, world: int, model_dir: str) -> dict[str, float]:
    """Max |packed - padded| of every per-token and per-sequence output, the loss and the grads
    at TP2xPP2 (+SP); also packed logprobs against transformers."""
    adapt_megatron_for_cpu()
    layout = ParallelLayout.for_world(world, tp=2, pp=2)
    initialize_model_parallel(layout)
    model, dims = build_model(model_dir, layout, opts=ModelOptions())
    samples = unequal_samples(dims.vocab_size)
    mask = samples.response_mask
    padded, packed = MicroBatching(2, None, False), MicroBatching(2, None, True)
    out: dict[str, float] = {}

    def logp(out_, mb):
        return response_log_probs(out_, mb, dims.vocab_size)[0]

    # old / reference logprobs (forward only, micro-batched)
    lp_pad = forward_response_tensor(model, samples, logp, padded)
    lp_pack = forward_response_tensor(model, samples, logp, packed)
    out["logprobs"] = _masked_rel(lp_pad, lp_pack, mask)
    hf = _hf_log_probs(model_dir, samples)
    out["packed_vs_hf"] = max(
        float((lp_pack[i, : len(h)] - h).abs().max()) for i, h in enumerate(hf)
    )
    # rollout scoring (the hybrid engine's path): the whole rollout as one micro-batch
    positions = response_positions(samples)
    tf_pad = teacher_forced_log_probs(model, samples.input_ids, positions, dims.vocab_size)
    tf_pack = teacher_forced_log_probs(
        model, samples.input_ids, positions, dims.vocab_size, seq_lens=samples.seq_lens()
    )
    out["rollout_logprobs"] = _masked_rel(tf_pad, tf_pack, mask)

    # actor update: PPO loss and grads
    samples.tensors.old_log_prob = lp_pad + 0.01 * samples.tensors.require("advantages")
    ddp, _, _ = wrap_for_training(model, OptimSettings(lr=1e-2, adam_eps=1e-3))
    loss_pad, grads_pad = _actor_step(ddp, dims, layout, samples, padded)
    loss_pack, grads_pack = _actor_step(ddp, dims, layout, samples, packed)
    out["loss"] = abs(loss_pad - loss_pack)
    out["loss_value"] = abs(loss_pad)
    out["grads"] = max(float((grads_pad[n] - grads_pack[n]).abs().max()) for n in grads_pad)
    out["grad_scale"] = max(float(g.abs().max()) for g in grads_pad.values())

    # critic values and reward-model scores (scalar heads)
    critic, _ = build_model(model_dir, layout, role="critic")
    _random_head(critic)
    v_pad = forward_response_tensor(critic, samples, response_values, padded)
    v_pack = forward_response_tensor(critic, samples, response_values, packed)
    out["values"] = _masked_max(v_pad, v_pack, mask)
    out["value_scale"] = float((v_pad.abs() * mask).max())
    lens = samples.seq_lens()
    s_pad = score_sequences(critic, samples.input_ids, lens, 2, pad_id=0)
    s_pack = score_sequences(critic, samples.input_ids, lens, 2, pad_id=0, packing=True)
    out["scores"] = float((s_pad - s_pack).abs().max())
    out.update(shared_prompt_check(ddp, critic, dims, layout))
    destroy_model_parallel()
    out.update(balance_check(world))  # no model: the DP token balance on 4 DP ranks
    return out


# Three prompts with 3, 1 and 2 samples (micro-batches of 4 split the first group's rows apart).
GROUP_PROMPT_LENS = [5, 3, 6]
GROUP_RESPONSE_LENS = [[4, 19, 1], [7], [12, 2]]


def grouped_samples(vocab: int) -> Samples:
    gen = torch.Generator().manual_seed(11)
    prompts, responses, groups = [], [], []
    for g, (p, lens) in enumerate(zip(GROUP_PROMPT_LENS, GROUP_RESPONSE_LENS, strict=True)):
        prompt = torch.randint(1, vocab, (p,), generator=gen).tolist()
        for n in lens:
            prompts.append(prompt)
            responses.append(torch.randint(1, vocab, (n,), generator=gen).tolist())
            groups.append(f"g{g}")
    samples = Samples.from_sequences(prompts, responses, groups, 0, "cpu")
    shape = samples.response_mask.shape
    samples.tensors.advantages = torch.randn(shape, generator=gen)
    samples.tensors.ref_log_prob = -torch.rand(shape, generator=gen) * 8
    return samples


def shared_prompt_check(ddp, critic, dims, layout) -> dict[str, float]:
    """actor.share_prompts against plain packing on groups of samples of one prompt: logprobs,
    the PPO loss and its grads, critic values (TP2xPP2 + SP, fp32)."""
    samples = grouped_samples(dims.vocab_size)
    mask = samples.response_mask
    packed, shared = MicroBatching(4, None, True), MicroBatching(4, None, True, True)

    def logp(out_, mb):
        return response_log_probs(out_, mb, dims.vocab_size)[0]

    lp_pack = forward_response_tensor(ddp, samples, logp, packed)
    lp_shared = forward_response_tensor(ddp, samples, logp, shared)
    samples.tensors.old_log_prob = lp_pack + 0.01 * samples.tensors.require("advantages")
    loss_pack, grads_pack = _actor_step(ddp, dims, layout, samples, packed)
    loss_shared, grads_shared = _actor_step(ddp, dims, layout, samples, shared)
    v_pack = forward_response_tensor(critic, samples, response_values, packed)
    v_shared = forward_response_tensor(critic, samples, response_values, shared)
    return {
        "shared_logprobs": _masked_rel(lp_pack, lp_shared, mask),
        "shared_loss": abs(loss_pack - loss_shared),
        "shared_loss_value": abs(loss_pack),
        "shared_grads": max(
            float((grads_pack[n] - grads_shared[n]).abs().max()) for n in grads_pack
        ),
        "shared_grad_scale": max(float(g.abs().max()) for g in grads_pack.values()),
        "shared_values": _masked_max(v_pack, v_shared, mask),
        "shared_value_scale": float((v_pack.abs() * mask).max()),
    }


def _skewed_rank_samples(dp_rank: int) -> tuple[Samples, torch.Tensor]:
    """Two groups of two samples on each rank; rank 0's responses are all long."""
    gen = torch.Generator().manual_seed(100 + dp_rank)
    long = dp_rank == 0
    prompts, responses, groups = [], [], []
    for g in range(2):
        prompt = torch.randint(1, 50, (3 + g,), generator=gen).tolist()
        for _ in range(2):
            n = int(torch.randint(40, 60, (1,), generator=gen)) if long else 1 + dp_rank + g
            prompts.append(prompt)
            responses.append(torch.randint(1, 50, (n,), generator=gen).tolist())
            groups.append(f"r{dp_rank}g{g}")
    samples = Samples.from_sequences(prompts, responses, groups, 0, "cpu")
    # a per-token tensor and a score that name their sample, to check they travel with it
    first = samples.input_ids[:, 0].float()
    samples.tensors.old_log_prob = first.unsqueeze(1) * samples.response_mask
    return samples, samples.response_lens.float() * 10 + first


def _records(samples: Samples, scores: torch.Tensor) -> list[tuple]:
    lens = samples.seq_lens().tolist()
    return sorted(
        (
            samples.group_ids[i],
            tuple(samples.input_ids[i, : lens[i]].tolist()),
            int(samples.prompt_lens[i]),
            float(scores[i]),
            tuple(
                samples.tensors.require("old_log_prob")[i, : int(samples.response_lens[i])].tolist()
            ),
        )
        for i in range(samples.size)
    )


def balance_check(world: int) -> dict[str, float]:
    """DP token balance over 4 DP ranks: samples, their tensors and scores, re-dealt by whole
    groups; the heaviest rank within mean + largest group."""
    import torch.distributed as dist

    from megarl import parallel
    from megarl.trainer.dp_balance import BEFORE, balance_over_data_parallel

    initialize_model_parallel(ParallelLayout.for_world(world))
    samples, scores = _skewed_rank_samples(parallel.dp_rank())
    balanced, new_scores, metrics = balance_over_data_parallel(samples, scores, pad_id=0)
    before_all: list = [None] * world
    after_all: list = [None] * world
    dist.all_gather_object(before_all, _records(samples, scores))
    dist.all_gather_object(after_all, _records(balanced, new_scores))
    tokens: list = [None] * world
    dist.all_gather_object(tokens, int(balanced.seq_lens().sum()))
    group_sets = [{rec[0] for rec in part} for part in after_all]
    largest = max(
        sum(len(rec[1]) for rec in part if rec[0] == g)
        for part in before_all
        for g in {rec[0] for rec in part}
    )
    destroy_model_parallel()
    return {
        "balance_same_samples": float(
            sorted(r for p in before_all for r in p) == sorted(r for p in after_all for r in p)
        ),
        "balance_whole_groups": float(
            sum(len(s) for s in group_sets) == len(set().union(*group_sets))
            and all(len(s) == 2 for s in group_sets)
        ),
        "balance_heaviest_minus_bound": max(tokens) - (sum(tokens) / world + largest),
        "balance_imbalance_before": metrics[BEFORE],
        "balance_imbalance_after": max(tokens) * world / sum(tokens) - 1.0,
    }
