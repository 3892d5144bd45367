"""What the trainer does with a megatron model: forward-only per-token tensors (logprobs, values)
and one PPO update (actor or critic), all micro-batched through megatron's pipeline schedule."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl import platform
from megarl.metrics import Reduce
from megarl.models.forward import LossOver, broadcast_from_last_stage, run_schedule
from megarl.models.logprobs import log_probs_at, positions_from
from megarl.models.moe_metrics import router_loss_metrics
from megarl.run.finite import NonFiniteError, all_finite
from megarl.run.trainable import Trainable
from megarl.trainer.batch import Samples
from megarl.trainer.dp_collectives import dp_mean
from megarl.trainer.ep_micro_batches import aligned_micro_batches
from megarl.trainer.routing_flags import combine_over_model_parallel, fill_response_flags
from megarl.trainer.token_tensors import TokenField


@dataclass(frozen=True)
class MicroBatching:
    size: int = 4
    max_tokens: int | None = None
    packing: bool = True  # actor.packing: each micro-batch as one pack of its sequences
    # actor.share_prompts: a pack holds each distinct prompt once (megarl.models.shared_prompts)
    share_prompts: bool = False

    def split(self, samples: Samples, rows: Sequence[int]) -> list[tuple[list[int], Samples]]:
        return aligned_micro_batches(
            samples, rows, self.size, self.max_tokens, self.packing, self.share_prompts
        )

    def inputs(self, mb: Samples) -> dict[str, torch.Tensor | Samples]:
        """What :func:`megarl.models.forward.run_schedule` takes for this micro-batch: its ids,
        the response positions, with packing the rows' real lengths, and with shared prompts
        their prompt lengths."""
        batch = {"input_ids": mb.input_ids, "mb": mb, "positions": response_positions(mb)}
        if self.packing:
            batch["seq_lens"] = mb.seq_lens()
        if self.share_prompts:  # config validation: only with packing
            batch["prompt_lens"] = mb.prompt_lens
        if mb.routes is not None:  # actor.router_replay
            batch["routes"] = mb.routes
        return batch


def _mini_batch_metric(
    values: Sequence[torch.Tensor], weights: Sequence[float], reduce: Reduce | None
) -> float:
    """One loss metric of a mini-batch from its micro-batches' values (see :func:`ppo_update`)."""
    if reduce is Reduce.MAX:
        return float(torch.stack(list(values)).max())
    if reduce is Reduce.MIN:
        return float(torch.stack(list(values)).min())
    return float(torch.stack([v * w for v, w in zip(values, weights, strict=True)]).sum())


def response_positions(mb: Samples) -> torch.Tensor:
    """``[b, R]`` sequence positions whose outputs predict (or value) response token j of each row
    (``prompt_len - 1 + j``); past a row's end they repeat its last position (masked later)."""
    return positions_from(mb.starts, mb.response_mask.shape[1], mb.input_ids.shape[1])


def response_log_probs(
    logits_shard: torch.Tensor,
    mb: Samples,
    vocab_size: int,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response-space ``[b, R]`` logprobs (and entropy) of one micro-batch from vocab-parallel
    logits computed at :func:`response_positions` (``[b, R, vocab/tp]``), of the distribution
    ``softmax(logits / temperature)``."""
    return log_probs_at(
        logits_shard,
        mb.input_ids,
        response_positions(mb),
        vocab_size,
        with_entropy,
        temperature=temperature,
    )


def response_values(output: torch.Tensor, mb: Samples) -> torch.Tensor:
    """Response-space ``[b, R]`` values from the critic's output at :func:`response_positions`."""
    return output[..., 0].float()


@torch.no_grad()
def forward_response_tensor(
    model,
    samples: Samples,
    extract: Callable[[torch.Tensor, Samples], torch.Tensor],
    batching: MicroBatching,
    routing_flags: torch.Tensor | None = None,
) -> torch.Tensor:
    """``extract(output, micro_batch)`` for every sample, as [N, R], on every pipeline stage;
    ``routing_flags`` (an ``[N, R]`` buffer, replayed MoE routers): filled with whether each
    token's routing agreed with the rollout's (megarl.trainer.routing_flags)."""
    result = torch.zeros_like(samples.response_mask, dtype=torch.float32)
    mbs = batching.split(samples, range(samples.size))
    inputs = [batching.inputs(mb) for _, mb in mbs]
    outputs = run_schedule(
        [model],
        inputs,
        lambda out, batch: (out.new_zeros(()), {"value": extract(out, batch["mb"]).float()}),
        forward_only=True,
    )
    for (rows, mb), out in zip(mbs, outputs, strict=False):
        width = mb.response_mask.shape[1]
        result[rows, :width] = out["value"]
    if routing_flags is not None:
        fill_response_flags(routing_flags, mbs, inputs)
        combine_over_model_parallel(routing_flags)
    return broadcast_from_last_stage(result)


def policy_log_probs(
    model,
    samples: Samples,
    vocab_size: int,
    temperature: float,
    batching: MicroBatching,
    routing_flags: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N, R]`` logprobs of every sample's response tokens under ``softmax(logits /
    temperature)``, forward-only in ``batching``'s micro-batches (the update's count or token
    budget) through the pipeline, on every stage: the old and the reference logprobs
    (``routing_flags``: see :func:`forward_response_tensor`)."""
    return forward_response_tensor(
        model,
        samples,
        lambda out, mb: response_log_probs(out, mb, vocab_size, temperature=temperature)[0],
        batching,
        routing_flags,
    )


def rollout_is_finite(samples: Samples, skip: bool) -> bool:
    """Whether every rank's rollout has finite actor logprobs on its response tokens.

    Broken weights show here first (the rollout is scored by the actor); with ``skip`` the step
    is to be skipped, otherwise this stops the run with a clear message.
    """
    mask = samples.response_mask.bool()
    old = samples.tensors.old_log_prob  # absent when the update gives it
    bad = old is not None and not bool(torch.isfinite(old[mask]).all())
    flag = torch.tensor([1.0 if bad else 0.0], device=platform.collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0.0:
        return True
    if not skip:
        raise NonFiniteError(
            "NaN or inf in the actor's logprobs of the rollout (the weights are no longer "
            "finite); stopping before any update (the last checkpoint is kept). Lower the "
            "learning rate, or set trainer.nan_policy=skip to skip such steps"
        )
    return False


def _weight(mb: Samples, mini_tokens: float, mini_seqs: int, token_level: bool) -> float:
    """This micro-batch's share of the mini-batch, so micro-batch losses add up to the mini-batch's."""
    if token_level:
        return float(mb.response_mask.sum()) / max(mini_tokens, 1.0)
    return mb.size / max(mini_seqs, 1)


def ppo_update(
    trainable: Trainable,
    role: str,
    samples: Samples,
    mini_batches: Sequence[Sequence[int]],
    epochs: int,
    batching: MicroBatching,
    loss_fn: LossOver[Samples],
    token_level: bool,
    skip_non_finite: bool = False,
    keep: TokenField | None = None,
    extremes: Mapping[str, Reduce] | None = None,
    routing_flags: torch.Tensor | None = None,
) -> list[dict[str, float]]:
    """``epochs`` x mini-batches x micro-batches of optimizer steps; returns per-step metrics
    (the loss function's, and ``<role>/grad_norm``, ``lr``, ``update_ok``, ``skipped_non_finite``).
    A loss metric is the mini-batch's: the micro-batches' values weighted by their share of it,
    or for a key ``extremes`` reduces by ``Reduce.MAX`` / ``Reduce.MIN`` their largest / smallest.

    ``keep``: a field of :class:`megarl.trainer.token_tensors.TokenTensors`, under whose name the
    loss function returns a per-token ``[b, R]`` tensor among its metrics; the first epoch's values
    of every row go into that field of ``samples.tensors`` (on every pipeline stage), e.g. the
    update's logprobs when they are the old ones; ``routing_flags``
    (an ``[N, R]`` buffer, replayed MoE routers): filled from the first epoch's forwards, as
    :func:`forward_response_tensor` fills it.

    megatron's DDP averages gradients over data-parallel ranks. Token-level losses are weighted
    by the tokens of the whole mini-batch (all data-parallel ranks), sequence-level ones by its
    sequences (the same count on every rank): either way the update and its metrics are those of
    the global mini-batch, whatever the data-parallel size.
    """
    ddp, optimizer, scheduler = trainable.ddp, trainable.optimizer, trainable.scheduler
    history = []
    kept = torch.zeros_like(samples.response_mask, dtype=torch.float32) if keep else None
    for epoch in range(epochs):
        for rows in mini_batches:
            mbs = batching.split(samples, rows)
            mini_tokens = float(samples.response_mask[list(rows)].sum())
            if token_level:
                mini_tokens = dp_mean(mini_tokens)
            weights = [_weight(mb, mini_tokens, len(rows), token_level) for _, mb in mbs]

            def scaled(out: torch.Tensor, batch: dict[str, Any]):
                loss, metrics = loss_fn(out, batch["mb"])
                return loss * batch["weight"], {k: v.detach().float() for k, v in metrics.items()}

            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            inputs = [
                {**batching.inputs(mb), "weight": w}
                for (_, mb), w in zip(mbs, weights, strict=True)
            ]
            outs = run_schedule([ddp], inputs, scaled, forward_only=False)
            if routing_flags is not None and epoch == 0:
                fill_response_flags(routing_flags, mbs, inputs)
            if keep and kept is not None:  # (kept exists only for a kept tensor)
                per_token = [o.pop(keep) for o in outs]
                if epoch == 0:
                    for (mb_rows, mb), values in zip(mbs, per_token, strict=False):
                        kept[mb_rows, : mb.response_mask.shape[1]] = values
            if not all_finite(ddp, outs):
                optimizer.zero_grad()
                if not skip_non_finite:
                    raise NonFiniteError(
                        "NaN or inf in the loss or gradients; stopping before the optimizer step "
                        "(the last checkpoint is kept). Lower the learning rate, or set "
                        "trainer.nan_policy=skip to skip such steps"
                    )
                history.append({f"{role}/skipped_non_finite": 1.0})
                continue
            ok, grad_norm, _ = optimizer.step()
            scheduler.step(increment=1)
            step_metrics = {
                f"{role}/grad_norm": float(grad_norm if grad_norm is not None else float("nan")),
                f"{role}/update_ok": float(bool(ok)),
                f"{role}/skipped_non_finite": 0.0,
                f"{role}/lr": float(optimizer.param_groups[0]["lr"]),
            }
            step_metrics.update(
                router_loss_metrics(role, len(mbs), trainable.model.config.num_layers)
            )
            if outs:
                for key in outs[0]:
                    step_metrics[key] = _mini_batch_metric(
                        [o[key] for o in outs], weights, (extremes or {}).get(key)
                    )
            history.append(step_metrics)
    if keep and kept is not None:
        samples.tensors.put(keep, broadcast_from_last_stage(kept))
    if routing_flags is not None:
        combine_over_model_parallel(routing_flags)
    return history
