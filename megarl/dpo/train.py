"""``trainer.kind: dpo`` (``megarl train-dpo``): direct preference optimisation (and the variants
registered in :mod:`megarl.algos.dpo`) in TP/PP/DP with the distributed optimizer; every rank
runs it (SPMD).

Per step: this DP rank's ``train_batch_size / dp`` pairs -> micro-batches of whole pairs (rows
``2i`` and ``2i + 1`` are pair ``i``'s chosen and rejected sequences, packed by default) -> the
frozen reference's summed response logprobs (forward only; with ``actor.lora`` the actor with its
adapters off) -> the policy's, and the ``dpo.loss`` of each pair, averaged over the rank's pairs
(megatron's DDP averages over DP ranks) -> one optimizer step. Metrics ``dpo/loss``,
``dpo/reward_accuracy``, ``dpo/reward_margin`` (the implicit rewards of the loss), validation
``val/dpo_loss``, ``val/dpo_reward_accuracy``, ``val/dpo_reward_margin`` over the whole
validation set. Checkpoints hold the policy as ``actor`` and export like the SFT trainer's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megarl import parallel, platform
from megarl.algos.choices import DPOLoss, resolve_dpo_loss
from megarl.algos.dpo import dpo_loss
from megarl.config import ActorConfig, DataConfig, DPOConfig, ModelConfig, ParallelConfig, RunConfig
from megarl.data import PreferenceDataset, PreferenceItem
from megarl.models.build import build_model
from megarl.models.dims import ModelDims
from megarl.models.forward import LossFn, run_schedule
from megarl.models.logprobs import log_probs_at
from megarl.models.lora import adapters_disabled
from megarl.run.evaluation import dataset_totals
from megarl.run.sequences import TokenRows, length_groups, token_rows
from megarl.run.startup import Startup
from megarl.run.supervised import SupervisedParts, SupervisedTrainer
from megarl.run.trainable import PolicyModel, build_policy, model_options
from megarl.run.update import optimizer_step, weighted

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

VAL_KEYS = ("loss", "reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward")


@dataclass(frozen=True)
class Reference:
    """The frozen reference policy: its own model, or the LoRA actor's base (adapters off)."""

    model: GPTModel
    dims: ModelDims
    is_actor_base: bool = False

    @contextmanager
    def active(self) -> Iterator[GPTModel]:
        ctx: AbstractContextManager = (
            adapters_disabled(self.model) if self.is_actor_base else nullcontext(self.model)
        )
        with ctx:
            yield self.model


def build_reference(
    dpo: DPOConfig,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    actor: ActorConfig,
    startup: Startup,
    policy: PolicyModel,
    loss: DPOLoss,
) -> Reference | None:
    """The reference of ``dpo.loss`` (None for a reference-free loss): dpo.reference_path, else
    the policy's own folder, or with LoRA (actor.lora) the policy's frozen base."""
    if not loss.needs_reference:
        return None
    path = dpo.reference_path
    if path is None and actor.lora.rank != 0:  # LoRA on: the adapters' base is the reference
        return Reference(policy.actor.model, policy.dims, is_actor_base=True)
    model, dims = build_model(
        path or model_cfg.path,
        startup.layout,
        "reference",
        model_options(model_cfg, parallel, actor.lora),
    )
    return Reference(model, dims)


def sequence_log_probs(
    logits_shard: torch.Tensor, rows: TokenRows, vocab_size: int
) -> torch.Tensor:
    """``[b]`` each row's summed logprob of its trained response tokens."""
    logp, _ = log_probs_at(logits_shard, rows.input_ids, rows.positions(), vocab_size)
    return (logp * rows.loss_mask.to(logp.device)).sum(-1)


def pair_inputs(
    logps: torch.Tensor, rows: TokenRows, ref_logps: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The DPO loss inputs of interleaved chosen/rejected rows."""
    tokens = rows.tokens().to(logps.device)
    out = {
        "chosen_logps": logps[0::2],
        "rejected_logps": logps[1::2],
        "chosen_tokens": tokens[0::2],
        "rejected_tokens": tokens[1::2],
    }
    if ref_logps is not None:
        ref = ref_logps.to(logps.device)
        out.update(ref_chosen_logps=ref[0::2], ref_rejected_logps=ref[1::2])
    return out


def dpo_loss_fn(name: str, kwargs: dict[str, Any], vocab_size: int) -> LossFn:
    """The loss of a micro-batch of pairs on vocab-parallel logits at its response positions:
    the pairs' mean loss scaled by ``batch["weight"]`` (their share of the batch); the metrics of
    :func:`megarl.algos.dpo.dpo_loss` on the same scale. The reference's logprobs come in
    ``batch["ref_logps"]``."""

    def loss_fn(logits_shard: torch.Tensor, batch: dict[str, Any]):
        rows: TokenRows = batch["rows"]
        logps = sequence_log_probs(logits_shard, rows, vocab_size)
        _, loss, metrics = dpo_loss(
            name, pair_inputs(logps, rows, batch.get("ref_logps")), **kwargs
        )
        return weighted(loss, metrics, batch["weight"])

    return loss_fn


def micro_batches(
    d: DPOConfig, items: list[PreferenceItem], pad_id: int, sums: bool = False
) -> list[dict[str, Any]]:
    """Micro-batches of ``dpo.micro_batch_size`` whole pairs, by length; each weighted by its
    share of the batch's pairs (``sums``: by its pairs, so metrics add up to sums over pairs)."""
    lens = [len(it.prompt_ids) + max(len(it.chosen_ids), len(it.rejected_ids)) for it in items]
    out = []
    for group in length_groups(lens, d.micro_batch_size):
        prompts, responses = [], []
        for i in group:
            it = items[i]
            prompts += [it.prompt_ids, it.prompt_ids]
            responses += [it.chosen_ids, it.rejected_ids]
        masks = [[1] * len(r) for r in responses]
        rows = token_rows(prompts, responses, masks, pad_id, platform.device())
        weight = len(group) / (1 if sums else len(items))
        out.append({**rows.schedule_inputs(d.packing), "rows": rows, "weight": weight})
    return out


@torch.no_grad()
def add_reference_log_probs(reference: Reference | None, mbs: list[dict[str, Any]]) -> None:
    """``mb["ref_logps"]``: the reference's summed response logprobs of each micro-batch's rows,
    on the last pipeline stage (where the loss reads them)."""
    if reference is None:
        return
    vocab = reference.dims.vocab_size

    def extract(out: torch.Tensor, batch: dict[str, Any]):
        return out.new_zeros(()), {"ref_logps": sequence_log_probs(out, batch["rows"], vocab)}

    with reference.active() as model:
        outs = run_schedule([model], mbs, extract, forward_only=True)
    for mb, out in zip(mbs, outs, strict=False):
        mb["ref_logps"] = out["ref_logps"].float()


def _dataset(
    d: DataConfig, dpo: DPOConfig, startup: Startup, *, validation: bool
) -> PreferenceDataset:
    files, batch = (
        (d.val_files, d.val_batch_size) if validation else (d.train_files, d.train_batch_size)
    )
    return PreferenceDataset(
        files,
        startup.tokenizer,
        batch_size_per_rank=batch // startup.layout.dp,
        max_length=dpo.max_length,
        dp_rank=parallel.dp_rank(),
        dp_size=startup.layout.dp,
        seed=d.seed,
        shuffle=d.shuffle and not validation,
        drop_last=not validation,  # validation: every pair once
        truncation=dpo.truncation,
        setting="data.val_files" if validation else "data.train_files",
    )


def _with_reference(
    dpo: DPOConfig, pad_id: int, reference: Reference | None, sums: bool
) -> Callable[[list[PreferenceItem]], list[dict[str, Any]]]:
    def build(items: list[PreferenceItem]) -> list[dict[str, Any]]:
        mbs = micro_batches(dpo, items, pad_id, sums)
        add_reference_log_probs(reference, mbs)
        return mbs

    return build


def _tokens(items: list[PreferenceItem]) -> int:
    """Tokens of a step's pairs: the prompt twice, both responses."""
    return sum(len(it.prompt_ids) * 2 + len(it.chosen_ids) + len(it.rejected_ids) for it in items)


def _setup(cfg: RunConfig, startup: Startup) -> SupervisedParts[PreferenceItem]:
    pad_id = startup.pad_id
    loss = resolve_dpo_loss(cfg.dpo, try_it=True)  # once, before any model is built
    train_data = _dataset(cfg.data, cfg.dpo, startup, validation=False)
    policy = build_policy(
        cfg.model, cfg.parallel, cfg.actor.lora, cfg.trainer, startup.layout, cfg.dpo.optim
    )
    reference = build_reference(cfg.dpo, cfg.model, cfg.parallel, cfg.actor, startup, policy, loss)
    loss_fn = dpo_loss_fn(cfg.dpo.loss, loss.kwargs, policy.dims.vocab_size)
    train_mbs = _with_reference(cfg.dpo, pad_id, reference, sums=False)
    val_mbs = _with_reference(cfg.dpo, pad_id, reference, sums=True)

    def step(items: list[PreferenceItem]) -> dict[str, float]:
        return optimizer_step(
            policy.actor,
            train_mbs(items),
            loss_fn,
            prefix="dpo",
            skip_non_finite=cfg.trainer.nan_policy == "skip",
            lr_setting="dpo.optim.lr",
        )

    def validate() -> dict[str, float]:
        data = _dataset(cfg.data, cfg.dpo, startup, validation=True)
        try:
            totals = dataset_totals(policy.actor.model, data, val_mbs, loss_fn, VAL_KEYS)
        finally:
            data.close()
        pairs = max(totals["items"], 1.0)
        out = {f"val/dpo_{k}": totals[k] / pairs for k in VAL_KEYS}
        out["val/dpo_pairs"] = totals["items"]
        return out

    return SupervisedParts(
        models=policy,
        train_data=train_data,
        step=step,
        validate=validate,
        tokens=_tokens,
        summary_key="dpo/reward_accuracy",
        empty="the training data yields no batch: fewer pairs than data.train_batch_size",
    )


# Direct preference optimisation of the policy (trainer.kind=dpo).
DPO: SupervisedTrainer[PreferenceItem] = SupervisedTrainer("actor", _setup)
