"""On-policy distillation (``algorithm.distill``): a frozen teacher scores the student's own
rollouts, and the per-token reverse KL ``log pi_student(y_t) - log pi_teacher(y_t)`` on the
sampled tokens steers the student toward the teacher, alone or beside the outcome reward.

The teacher is a Hugging Face causal LM of the student's tokenizer (checked before launch), built
frozen at the policy's layout (it may be bigger: its own layers and widths split the same TP x PP
way) and scored like the reference, through the pipeline at the sampling temperature. Two places
for the KL, ``algorithm.distill.mode``:

- ``reward``: a dense reward with no credit to earlier tokens: every response token's advantage
  gets ``-coef * (student - teacher logprob)`` of its own token, added to the outcome advantages
  of the estimator (the student logprob is the rollout's, before the update). Not through the
  estimator's rewards: GRPO sums a response's token rewards into one score, which turns a
  per-token KL into a length penalty (measured on the toy task: the student learnt to answer
  with nothing, reward 0.43 -> 0.0 in 10 steps, responses 31 -> 1 token);
- ``loss``: ``coef * agg(k2)`` in the actor loss, ``k2 = (student - teacher)^2 / 2``, whose
  gradient on the sampled tokens is the reverse KL's policy gradient.

Either way ``distill/reverse_kl`` is the token mean of ``student - teacher`` over the batch's
response tokens (an estimate of KL(student || teacher) per token) and
``distill/teacher_log_prob`` the teacher's mean logprob of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megarl.algos import kl_loss, masked_mean
from megarl.config import DistillConfig
from megarl.metrics import StepMetrics, mean
from megarl.models.build import ModelOptions, build_model
from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.trainer.batch import Samples
from megarl.trainer.model_ops import MicroBatching, forward_response_tensor, response_log_probs

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


@dataclass(frozen=True)
class Teacher:
    model: GPTModel
    dims: ModelDims
    settings: DistillConfig  # algorithm.distill: its mode and coefficient


def build_teacher(d: DistillConfig, layout: ParallelLayout, opts: ModelOptions) -> Teacher | None:
    """The frozen teacher of ``algorithm.distill.teacher_path`` (None: no distillation)."""
    if d.teacher_path is None:
        return None
    model, dims = build_model(d.teacher_path, layout, "reference", opts)
    return Teacher(model, dims, d)


def distill_experience(
    teacher: Teacher, samples: Samples, batching: MicroBatching, temperature: float
) -> StepMetrics:
    """Score the rollout with the teacher (``samples.tensors.teacher_log_prob``); in reward
    mode, add the reverse-KL advantage per token to ``samples.tensors.advantages``."""
    t, mask = samples.tensors, samples.response_mask
    vocab = teacher.dims.vocab_size
    teacher_log_prob = forward_response_tensor(
        teacher.model,
        samples,
        lambda out, mb: response_log_probs(out, mb, vocab, temperature=temperature)[0],
        batching,
    )
    t.teacher_log_prob = teacher_log_prob
    d = teacher.settings
    metrics: StepMetrics = {
        "distill/teacher_log_prob": mean(masked_mean(teacher_log_prob, mask)),
    }
    if d.mode == "reward":
        kl = t.require("old_log_prob") - teacher_log_prob
        t.advantages = t.require("advantages") - d.coef * kl * mask
        metrics["distill/reverse_kl"] = mean(masked_mean(kl, mask))
    return metrics


def distill_loss_term(
    d: DistillConfig, log_prob: torch.Tensor, mb: Samples, agg_mode: str, agg_kwargs: dict
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """In loss mode (``algorithm.distill``), ``coef * agg(k2(student, teacher))`` of a
    micro-batch (None otherwise), and its ``distill/reverse_kl`` metric."""
    if d.teacher_path is None or d.mode != "loss":
        return None, {}
    teacher = mb.tensors.require("teacher_log_prob")
    term, _ = kl_loss(
        log_prob,
        teacher,
        mb.response_mask,
        kl_coef=d.coef,
        estimator="k2",
        loss_agg_mode=agg_mode,
        loss_agg_kwargs=agg_kwargs,
    )
    kl = masked_mean(log_prob.detach() - teacher, mb.response_mask)
    return term, {"distill/reverse_kl": kl}
