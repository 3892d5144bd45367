"""Rank-side body of the reward-model parity test (imported by spawned gloo processes)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from megarl.models.build import build_model
from megarl.models.distributed import OptimSettings, wrap_for_training
from megarl.models.export import iter_stage_hf_tensors
from megarl.models.forward import run_schedule
from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
from megarl.platform import adapt_megatron_for_cpu

MARGIN = 0.25


def preference_items(vocab: int, pad_id: int, pairs: int = 5) -> list[SimpleNamespace]:
    """Pairs of different lengths; no token equals the pad id (transformers stops there)."""
    gen = torch.Generator().manual_seed(5)

    def ids(n: int) -> list[int]:
        return (torch.randint(pad_id + 1, vocab, (n,), generator=gen)).tolist()

    return [
        SimpleNamespace(prompt_ids=ids(4 + i), chosen_ids=ids(3 + 2 * i), rejected_ids=ids(6 - i))
        for i in range(pairs)
    ]


def _hf_reference(model_dir: str, items, pad_id: int):
    """Loss, per-sequence scores and grads of transformers' sequence classifier."""
    from transformers import AutoModelForSequenceClassification

    from megarl.reward_model.pairs import pad_sequences

    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    seqs = [
        s for it in items for s in (it.prompt_ids + it.chosen_ids, it.prompt_ids + it.rejected_ids)
    ]
    ids, _ = pad_sequences(seqs, pad_id, "cpu")
    scores = hf(input_ids=ids).logits[:, 0]
    loss = -F.logsigmoid(scores[0::2] - scores[1::2] - MARGIN).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    return loss.item(), scores.detach(), grads


def reward_model_worker(rank: int, world: int, model_dir: str) -> dict[str, float]:
    adapt_megatron_for_cpu()
    from megarl.reward_model.pairs import pad_sequences
    from megarl.reward_model.train import _micro_batches, _pair_loss
    from megarl.rewards.model import score_sequences

    layout = ParallelLayout.for_world(world, tp=2, pp=2)
    initialize_model_parallel(layout)
    model, dims = build_model(model_dir, layout, "reward")
    pad_id = 0
    items = preference_items(dims.vocab_size, pad_id)
    ref_loss, ref_scores, ref_grads = _hf_reference(model_dir, items, pad_id)
    ddp, optimizer, _ = wrap_for_training(model, OptimSettings(lr=1e-3))
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    rm = SimpleNamespace(micro_batch_size=2)
    batches = _micro_batches(rm, items, pad_id)
    outs = run_schedule([ddp], batches, _pair_loss(MARGIN), forward_only=False)
    out: dict[str, float] = {"micro_batches": float(len(batches))}
    if outs:  # last stage
        loss = sum(float(o["loss"]) for o in outs)
        out["loss_diff"] = abs(loss - ref_loss)
        out["loss"] = loss
    grads = dict(iter_stage_hf_tensors(ddp, dims, layout, use_main_grad=True, role="reward"))
    out["grad_diff"] = max((g - ref_grads[n]).abs().max().item() for n, g in grads.items())
    out["grad_ref_max"] = max(ref_grads[n].abs().max().item() for n in grads)
    out["has_score_grad"] = float("score.weight" in grads)
    seqs = [
        s for it in items for s in (it.prompt_ids + it.chosen_ids, it.prompt_ids + it.rejected_ids)
    ]
    ids, lens = pad_sequences(seqs, pad_id, "cpu")
    scores = score_sequences(model, ids, lens, micro_batch_size=3, pad_id=pad_id)
    out["score_diff"] = (scores - ref_scores).abs().max().item()
    # pad == EOS: responses that end with the EOS token; transformers reads the last non-pad token
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    assert hf.config.pad_token_id == pad_id
    eos_ids, eos_lens = pad_sequences([[*s, pad_id] for s in seqs], pad_id, "cpu")
    with torch.no_grad():
        hf_eos = hf(input_ids=eos_ids).logits[:, 0]
    eos_scores = score_sequences(model, eos_ids, eos_lens, micro_batch_size=3, pad_id=pad_id)
    out["eos_score_diff"] = (eos_scores - hf_eos).abs().max().item()
    # reading the EOS position instead (the previous behaviour) would differ from transformers
    at_eos = score_sequences(model, eos_ids, eos_lens, micro_batch_size=3)
    out["at_eos_diff"] = (at_eos - hf_eos).abs().max().item()
    # bf16: every parameter in one dtype (megatron's local RMSNorm would stay float32, which the
    # weight reshard's buffers, sized by dtype, cannot mix)
    from megarl.models.build import ModelOptions

    bf16, _ = build_model(model_dir, layout, "reward", ModelOptions(dtype=torch.bfloat16))
    out["bf16_dtypes"] = float(len({p.dtype for p in bf16.parameters()} - {torch.bfloat16}) == 0)
    destroy_model_parallel()
    return out
