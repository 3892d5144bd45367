"""On-policy distillation's per-token terms (``algorithm.distill``), with the teacher's forward
stood in for: reward mode stores the teacher's logprobs and takes ``coef * (student - teacher)``
off each response token's advantage; loss mode reads the stored teacher logprobs and fails
naming the teacher pass when they are absent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.config.schema import DistillConfig
from megarl.trainer import distill
from megarl.trainer.batch import Samples
from megarl.trainer.model_ops import MicroBatching
from megarl.trainer.token_tensors import MissingTokenTensor

pytestmark = pytest.mark.unit


def _samples() -> tuple[Samples, torch.Tensor]:
    s = Samples.from_sequences([[1, 2], [3]], [[4, 5, 6], [7]], [0, 0], pad_id=0, device="cpu")
    s.tensors.old_log_prob = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    s.tensors.advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    teacher = torch.tensor([[-1.5, -1.0, -3.0], [-0.25, -9.0, -9.0]])
    return s, teacher


def test_reward_mode_takes_the_reverse_kl_off_each_tokens_advantage(monkeypatch):
    samples, teacher_lp = _samples()
    monkeypatch.setattr(distill, "forward_response_tensor", lambda *args: teacher_lp)
    settings = DistillConfig(teacher_path="/teacher", coef=0.5, mode="reward")
    teacher = distill.Teacher(model=None, dims=SimpleNamespace(vocab_size=8), settings=settings)  # type: ignore[arg-type]
    metrics = distill.distill_experience(teacher, samples, MicroBatching(), temperature=1.0)
    assert torch.equal(samples.tensors.require("teacher_log_prob"), teacher_lp)
    # student - teacher on the 4 response tokens: 0.5, -1, 0 | -0.25 (padding: masked out)
    expected = torch.tensor([[0.75, 1.5, 1.0], [-0.875, -1.0, -1.0]])
    assert torch.allclose(samples.tensors.require("advantages"), expected)
    assert metrics["distill/reverse_kl"].value == pytest.approx((0.5 - 1.0 + 0.0 - 0.25) / 4)
    assert metrics["distill/teacher_log_prob"].value == pytest.approx((-1.5 - 1 - 3 - 0.25) / 4)


def test_loss_mode_reads_the_teacher_logprobs_the_teacher_pass_stored():
    samples, teacher_lp = _samples()
    settings = DistillConfig(teacher_path="/teacher", coef=1.0, mode="loss")
    student = samples.tensors.require("old_log_prob")
    with pytest.raises(MissingTokenTensor, match="distill_experience"):
        distill.distill_loss_term(settings, student, samples, "token-mean", {})
    samples.tensors.teacher_log_prob = teacher_lp
    term, metrics = distill.distill_loss_term(settings, student, samples, "token-mean", {})
    assert term is not None
    # k2 = (student - teacher)^2 / 2 over the 4 response tokens
    assert float(term) == pytest.approx((0.25 + 1.0 + 0.0 + 0.0625) / 2 / 4)
    assert float(metrics["distill/reverse_kl"]) == pytest.approx((0.5 - 1.0 + 0.0 - 0.25) / 4)
