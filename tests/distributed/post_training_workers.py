"""Rank-side body of the SFT / DPO / distillation parity test (imported by spawned gloo processes).

One model-parallel layout (TP2 x PP2 with sequence parallelism, every micro-batch packed) serves
three checks against references megarl did not write:
- SFT: the loss, per-token accuracy and every gradient of a batch equal transformers' on the same
  tokens, and one distributed-optimizer step equals torch AdamW's;
- DPO: TRL's DPOTrainer (run beforehand in its own process) tokenizes the same pairs into the same
  ids, and its loss, rewards, reward accuracy, margins and logprobs equal megarl's for each loss
  type, its gradients for the sigmoid loss;
- a teacher bigger than the policy, built at the policy's layout, scores response tokens as
  transformers does.

Then the SFT and DPO trainers as users start them (``megarl train-sft`` / ``train-dpo`` with the
chain's configs, run in place on the same ranks): 4 steps at TP2 x PP2 saving after step 2, and
the step-2 checkpoint resumed at another layout (SFT: DP4; DPO: PP2 x DP2) for steps 3 and 4.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from megarl.data import PreferenceDataset, SFTDataset
from megarl.models.build import build_model
from megarl.models.distributed import OptimSettings, wrap_for_training
from megarl.models.export import iter_stage_hf_tensors
from megarl.models.forward import run_schedule
from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
from megarl.platform import adapt_megatron_for_cpu

SETTINGS = OptimSettings(lr=1e-2, weight_decay=0.1, adam_eps=1e-3, clip_grad=0.5)
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "sigmoid_norm")
TRL_METRICS = {
    "rewards/chosen": "chosen_reward",
    "rewards/rejected": "rejected_reward",
    "rewards/accuracies": "reward_accuracy",
    "rewards/margins": "reward_margin",
    "logps/chosen": "chosen_logp",
    "logps/rejected": "rejected_logp",
}


def _hf(model_dir: str):
    """transformers' model, its embedding's ``padding_idx`` off: the tiny chat model's pad token
    is also its end-of-turn token, trained in every response, and ``padding_idx`` would drop that
    row's input-embedding gradient (megatron's embedding, like the math, keeps it)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.get_input_embeddings().padding_idx = None
    return hf


def _named(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A tensor by megarl's HF name; a tied LM head is the embedding in transformers' parameters."""
    if name not in tensors and name == "lm_head.weight":
        return tensors["model.embed_tokens.weight"]
    return tensors[name]


def _max_diff(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    import os

    if os.environ.get("MEGARL_DEBUG"):
        print({n: (t - _named(ref, n)).abs().max().item() for n, t in ours.items()}, flush=True)
    return max((t - _named(ref, n)).abs().max().item() for n, t in ours.items())


def _padded(items, pad_id: int):
    from megarl.run.sequences import token_rows

    return token_rows(
        [it.prompt_ids for it in items],
        [it.response_ids for it in items],
        [it.loss_mask for it in items],
        pad_id,
        "cpu",
    )


def _hf_sft_step(model_dir: str, items, pad_id: int):
    """transformers: token-mean NLL of the trained tokens, their top-1 accuracy, the gradients,
    then one torch AdamW step (with the same clipping and weight decay split as megatron's)."""
    hf = _hf(model_dir)
    hf.train()
    rows = _padded(items, pad_id)
    positions = rows.positions()
    logits = hf(rows.input_ids).logits  # each row alone: causal, padding at the end
    logp = F.log_softmax(logits, dim=-1)
    picked_logits = logits.gather(1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    targets = rows.input_ids.gather(1, (positions + 1).clamp(max=rows.input_ids.shape[1] - 1))
    token_logp = logp.gather(1, positions.unsqueeze(-1).expand(-1, -1, logp.shape[-1]))
    token_logp = token_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    mask = rows.loss_mask
    loss = -(token_logp * mask).sum() / mask.sum()
    accuracy = ((picked_logits.argmax(-1) == targets).float() * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    decay = [p for _, p in hf.named_parameters() if p.ndim > 1]
    no_decay = [p for _, p in hf.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": SETTINGS.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=SETTINGS.lr,
        betas=(SETTINGS.adam_beta1, SETTINGS.adam_beta2),
        eps=SETTINGS.adam_eps,
        fused=True,  # transformers' Trainer default; megarl's optimizer runs the same kernel
    )
    torch.nn.utils.clip_grad_norm_(hf.parameters(), SETTINGS.clip_grad)
    opt.step()
    weights = {n: p.detach().clone() for n, p in hf.named_parameters()}
    return float(loss), float(accuracy), float(mask.sum()), grads, weights


def _sft_checks(policy_dir: str, sft_file: str, layout, tokenizer) -> dict[str, float]:
    from megarl.run.update import sum_outputs
    from megarl.sft.train import micro_batches, sft_loss

    pad_id = tokenizer.pad_token_id
    data = SFTDataset(sft_file, tokenizer, batch_size_per_rank=5, max_length=512, shuffle=False)
    [items] = list(data)
    data.close()
    ref_loss, ref_acc, tokens, ref_grads, ref_weights = _hf_sft_step(policy_dir, items, pad_id)
    model, dims = build_model(policy_dir, layout)
    ddp, optimizer, _ = wrap_for_training(model, SETTINGS)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    sft = SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None, packing=True)
    mbs = micro_batches(sft, items, pad_id, norm=tokens)
    outs = run_schedule([ddp], mbs, sft_loss(dims.vocab_size), forward_only=False)
    out: dict[str, float] = {
        "sft:micro_batches": float(len(mbs)),
        "sft:packed": float(all("seq_lens" in mb for mb in mbs)),
        "sft:masked_tokens": float(sum(len(it.response_ids) - sum(it.loss_mask) for it in items)),
    }
    if outs:
        sums = sum_outputs(outs)
        out["sft:loss_rel"] = abs(sums["loss"] - ref_loss) / abs(ref_loss)
        out["sft:accuracy_diff"] = abs(sums["token_accuracy"] - ref_acc)
    grads = dict(iter_stage_hf_tensors(ddp, dims, layout, use_main_grad=True))
    out["sft:grad"] = _max_diff(grads, ref_grads)
    out["sft:grad_ref_max"] = max(_named(ref_grads, n).abs().max().item() for n in grads)
    ok, _, _ = optimizer.step()
    out["sft:step_ok"] = float(bool(ok))
    out["sft:weight"] = _max_diff(dict(iter_stage_hf_tensors(ddp, dims, layout)), ref_weights)
    return out


def _dpo_checks(policy_dir: str, reference_dir: str, pairs_file: str, trl: dict, layout, tokenizer):
    from megarl.dpo.train import Reference, add_reference_log_probs, dpo_loss_fn, micro_batches
    from megarl.run.update import sum_outputs

    pad_id = tokenizer.pad_token_id
    data = PreferenceDataset(
        pairs_file, tokenizer, batch_size_per_rank=5, max_length=512, shuffle=False
    )
    [items] = list(data)
    data.close()
    out: dict[str, float] = {}
    ours = [
        {"prompt_ids": it.prompt_ids, "chosen_ids": it.chosen_ids, "rejected_ids": it.rejected_ids}
        for it in items
    ]
    out["dpo:same_ids_as_trl"] = float(ours == trl["sigmoid"]["ids"])
    model, dims = build_model(policy_dir, layout)
    ddp, optimizer, _ = wrap_for_training(model, SETTINGS)
    ref_model, ref_dims = build_model(reference_dir, layout, "reference")
    reference = Reference(ref_model, ref_dims)
    dpo = SimpleNamespace(micro_batch_size=2, packing=True)
    for loss_type in DPO_LOSSES:
        mbs = micro_batches(dpo, items, pad_id)
        add_reference_log_probs(reference, mbs)
        kwargs = {"beta": trl["beta"]}
        if loss_type == "robust":
            kwargs["label_smoothing"] = trl["label_smoothing"]
        loss_fn = dpo_loss_fn(loss_type, kwargs, dims.vocab_size)
        backward = loss_type == "sigmoid"
        if backward:
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
        outs = run_schedule([ddp], mbs, loss_fn, forward_only=not backward)
        if outs:
            sums, expected = sum_outputs(outs), trl[loss_type]
            out[f"dpo:{loss_type}:loss"] = abs(sums["loss"] - expected["loss"])
            out[f"dpo:{loss_type}:loss_value"] = sums["loss"]
            for trl_key, key in TRL_METRICS.items():
                value = expected["metrics"][trl_key]
                out[f"dpo:{loss_type}:{key}"] = abs(sums[key] - value) / max(1.0, abs(value))
            out[f"dpo:{loss_type}:reward_accuracy_value"] = sums["reward_accuracy"]
        if backward:
            grads = dict(iter_stage_hf_tensors(ddp, dims, layout, use_main_grad=True))
            out["dpo:grad"] = _max_diff(grads, trl["sigmoid"]["grads"])
            out["dpo:grad_ref_max"] = max(
                _named(trl["sigmoid"]["grads"], n).abs().max().item() for n in grads
            )
    out.update(_lora_reference_checks(policy_dir, items, layout, pad_id))
    return out


def _lora_reference_checks(policy_dir: str, items, layout, pad_id: int) -> dict[str, float]:
    """With LoRA the reference is the actor's own base (its adapters off): after a DPO step on
    the adapters, it still scores as the plain model of ``policy_dir`` does, and the policy
    (adapters on) no longer does."""
    from megarl.dpo.train import Reference, add_reference_log_probs, dpo_loss_fn, micro_batches
    from megarl.models.lora import LoraSettings
    from megarl.run.trainable import build_trainable
    from megarl.run.update import optimizer_step

    lora = LoraSettings(rank=4, alpha=8.0, seed=1)
    trainable, dims = build_trainable(policy_dir, layout, "actor", None, SETTINGS, lora=lora)
    base = Reference(trainable.model, dims, is_actor_base=True)
    plain, plain_dims = build_model(policy_dir, layout, "reference")
    dpo = SimpleNamespace(micro_batch_size=2, packing=True)
    loss_fn = dpo_loss_fn("sigmoid", {"beta": 0.3}, dims.vocab_size)
    mbs = micro_batches(dpo, items, pad_id)
    add_reference_log_probs(base, mbs)
    step = optimizer_step(
        trainable, mbs, loss_fn, prefix="dpo", skip_non_finite=False, lr_setting="lr"
    )
    after, expected, policy = (micro_batches(dpo, items, pad_id) for _ in range(3))
    add_reference_log_probs(base, after)
    add_reference_log_probs(Reference(plain, plain_dims), expected)
    add_reference_log_probs(Reference(trainable.model, dims), policy)
    out = {"lora:step_ok": step["dpo/update_ok"]}
    if "ref_logps" in after[0]:  # the last stage
        out["lora:base_vs_plain"] = max(
            (a["ref_logps"] - e["ref_logps"]).abs().max().item()
            for a, e in zip(after, expected, strict=True)
        )
        out["lora:policy_vs_plain"] = max(
            (p["ref_logps"] - e["ref_logps"]).abs().max().item()
            for p, e in zip(policy, expected, strict=True)
        )
    return out


def _teacher_checks(teacher_dir: str, items, layout, pad_id: int) -> dict[str, float]:
    """A teacher of other dims than the policy, at the policy's layout, scores the response
    tokens of packed micro-batches as transformers does."""
    from megarl.config import DistillConfig
    from megarl.trainer.batch import Samples
    from megarl.trainer.distill import Teacher
    from megarl.trainer.model_ops import MicroBatching, forward_response_tensor, response_log_probs

    model, dims = build_model(teacher_dir, layout, "reference")
    teacher = Teacher(model, dims, DistillConfig(teacher_path=teacher_dir))
    samples = Samples.from_sequences(
        [it.prompt_ids for it in items],
        [it.chosen_ids for it in items],
        list(range(len(items))),
        pad_id,
        "cpu",
    )
    ours = forward_response_tensor(
        teacher.model,
        samples,
        lambda o, mb: response_log_probs(o, mb, dims.vocab_size, temperature=0.7)[0],
        MicroBatching(size=2, packing=True),
    )
    hf = _hf(teacher_dir)
    worst = 0.0
    with torch.no_grad():
        for i, it in enumerate(items):
            ids = torch.tensor([it.prompt_ids + it.chosen_ids])
            logp = F.log_softmax(hf(ids).logits[0] / 0.7, dim=-1)
            start = len(it.prompt_ids) - 1
            expected = logp[start : start + len(it.chosen_ids)].gather(
                -1, torch.tensor(it.chosen_ids).unsqueeze(-1)
            )[:, 0]
            worst = max(worst, (ours[i, : len(it.chosen_ids)] - expected).abs().max().item())
    return {"teacher:logprob": worst, "teacher:layers": float(dims.num_layers)}


def post_training_worker(
    rank: int,
    world: int,
    policy_dir: str,
    reference_dir: str,
    teacher_dir: str,
    sft_file: str,
    pairs_file: str,
    trl_file: str,
    runs: dict,
) -> dict[str, float]:
    adapt_megatron_for_cpu()
    trl = torch.load(trl_file, weights_only=True)
    from transformers import AutoTokenizer

    layout = ParallelLayout.for_world(world, tp=2, pp=2)
    initialize_model_parallel(layout)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    out = _sft_checks(policy_dir, sft_file, layout, tokenizer)
    out.update(_dpo_checks(policy_dir, reference_dir, pairs_file, trl, layout, tokenizer))
    data = PreferenceDataset(pairs_file, tokenizer, batch_size_per_rank=5, max_length=512)
    [items] = list(data)
    data.close()
    out.update(_teacher_checks(teacher_dir, items, layout, tokenizer.pad_token_id))
    destroy_model_parallel()
    out.update(_resume_checks(runs))
    return out


def _run_trainer(verb: str, config: str, overrides: list[str], out: str) -> dict[int, dict]:
    """``megarl VERB CONFIG overrides`` on these ranks (the command line runs in place under a
    launcher, as under torchrun or srun); the run's metrics by step."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from megarl.cli import main

    code = main([verb, config, *overrides, f"trainer.output_dir={out}"])
    assert code == 0, (verb, code)
    destroy_model_parallel()
    dist.barrier()  # rank 0 has written the metrics
    steps: dict[int, dict] = {}
    for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record)
    return steps


RESUME_KEYS = {
    "sft": ("sft/loss", "sft/token_accuracy", "sft/grad_norm"),
    "dpo": ("dpo/loss", "dpo/reward_margin", "dpo/grad_norm"),
}


def _resume_checks(runs: dict) -> dict[str, float]:
    """``megarl train-sft`` / ``train-dpo`` with the chain's configs at TP2 x PP2 for 4 steps
    (checkpoints after steps 2 and 4), then the step-2 checkpoint resumed at another layout (SFT:
    DP4; DPO: PP2 x DP2): relative differences of steps 3 and 4's metrics; DPO's validation
    reward accuracy on held-out pairs before and after."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    out: dict[str, float] = {}
    work = Path(runs["work"])
    for name, spec in runs["trainers"].items():
        verb, config, overrides, other_layout = spec
        full = _run_trainer(verb, config, overrides, str(work / f"{name}_full"))
        ckpts = work / f"{name}_resumed" / "checkpoints"
        if dist.get_rank() == 0:
            src = work / f"{name}_full" / "checkpoints" / "step_00000002"
            shutil.copytree(src, ckpts / "step_00000002")
            (ckpts / "latest").write_text("step_00000002\n")
        dist.barrier()
        resumed = _run_trainer(
            verb, config, [*overrides, *other_layout], str(work / f"{name}_resumed")
        )
        out[f"{name}:resumed_from"] = float(min(s for s in resumed if s > 0))
        for step in (3, 4):
            for key in RESUME_KEYS[name]:
                a, b = full[step][key], resumed[step][key]
                out[f"{name}:step{step}:{key}"] = abs(a - b) / max(abs(a), 1e-3)
        if name == "dpo":
            out["dpo:val_accuracy_before"] = full[0]["val/dpo_reward_accuracy"]
            out["dpo:val_accuracy_after"] = full[4]["val/dpo_reward_accuracy"]
            out["dpo:val_pairs"] = full[4]["val/dpo_pairs"]
    return out
