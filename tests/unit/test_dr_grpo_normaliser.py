"""Dr. GRPO's ``seq-mean-token-sum-norm``: the actor loss of one batch is the same whatever the
micro-batching and the data-parallel split, because each sequence's token sum is divided by one
constant (rollout.sampling.max_response_length by default), not by a micro-batch's padded width."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from megarl.algos import agg_loss
from megarl.config import load_config
from megarl.trainer.batch import Samples, micro_batches
from megarl.trainer.model_ops import _weight
from tests.policy_terms import policy_terms

pytestmark = pytest.mark.unit

MAX_RESPONSE = 24


class Forward(NamedTuple):
    """What the actor's forward would give for every sample (stood in for by noise)."""

    log_prob: torch.Tensor
    entropy: torch.Tensor

    def rows(self, idx: list[int], width: int) -> Forward:
        """Those of the samples ``idx`` (a micro-batch's rows), trimmed to its response width."""
        return Forward(self.log_prob[idx, :width], self.entropy[idx, :width])


def batch(n_prompts: int = 4, n: int = 4) -> tuple[Samples, Forward]:
    gen = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(
            1, 50, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(n_prompts)
    ]
    responses, groups, seq_prompts = [], [], []
    for p in range(n_prompts):
        for _ in range(n):
            length = int(torch.randint(0, MAX_RESPONSE + 1, (1,), generator=gen))  # some empty
            responses.append(torch.randint(1, 50, (length,), generator=gen).tolist())
            groups.append(p)
            seq_prompts.append(prompts[p])
    s = Samples.from_sequences(seq_prompts, responses, groups, pad_id=0, device="cpu")
    shape = s.response_mask.shape
    s.tensors.old_log_prob = -torch.rand(shape, generator=gen)
    s.tensors.ref_log_prob = -torch.rand(shape, generator=gen)
    s.tensors.advantages = torch.randn(shape[0], 1, generator=gen).expand(shape).clone()
    new_log_prob = s.tensors.require("old_log_prob") + 0.3 * torch.randn(shape, generator=gen)
    return s, Forward(new_log_prob, torch.rand(shape, generator=gen))


def rank_loss(cfg, samples: Samples, forward: Forward, rows: list[int], micro: int) -> torch.Tensor:
    """One rank's mini-batch loss as the trainer builds it: micro-batches sorted by length, each
    loss weighted by its share of the mini-batch (model_ops.ppo_update)."""
    terms = policy_terms(cfg)
    token_level = cfg.algorithm.loss_agg_mode == "token-mean"
    mini_tokens = float(samples.response_mask[rows].sum())
    total = torch.zeros(())
    for idx, mb in micro_batches(samples, rows, micro):
        logp, entropy = forward.rows(idx, mb.response_mask.shape[1])
        loss, _ = terms(logp, entropy, mb)
        total = total + loss * _weight(mb, mini_tokens, len(rows), token_level)
    return total


def dp_loss(cfg, samples: Samples, forward: Forward, dp: int, micro: int) -> torch.Tensor:
    """megatron's DDP averages the ranks' gradients: the loss is the mean of the ranks' losses.
    Each rank holds whole prompt groups (rows are prompt-major)."""
    per_rank = samples.size // dp
    ranks = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(dp)]
    return torch.stack([rank_loss(cfg, samples, forward, rows, micro) for rows in ranks]).mean()


def test_dr_grpo_loss_is_the_same_for_any_micro_batching_and_dp_split():
    cfg = load_config(
        overrides=[
            "model.path=/m",
            "data.train_files=[a.parquet]",
            "algorithm.loss_agg_mode=seq-mean-token-sum-norm",
            "algorithm.norm_adv_by_std=false",
            "algorithm.entropy_coef=0.01",
            f"rollout.sampling.max_response_length={MAX_RESPONSE}",
            "rollout.sampling.n=4",
        ]
    )
    samples, forward = batch()
    reference = dp_loss(
        cfg, samples, forward, dp=1, micro=samples.size
    )  # one micro-batch, one rank
    losses = {
        (dp, micro): float(dp_loss(cfg, samples, forward, dp, micro))
        for dp in (1, 2, 4)
        for micro in (1, 3, 4, 16)
    }
    for key, value in losses.items():
        assert value == pytest.approx(float(reference), abs=1e-6), (key, losses)

    # the value itself: (1/N) sum_i sum_t loss_it / max_response_length, by hand for the pg term
    mask = samples.response_mask.bool()
    ratio = torch.exp(forward.log_prob - samples.tensors.require("old_log_prob"))
    adv = samples.tensors.require("advantages")
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    pg = torch.where((adv < 0) & (pg > -adv * 3.0), -adv * 3.0, pg)  # ppo_clip's dual clip
    expected_pg = (pg * mask).sum() / MAX_RESPONSE / samples.size
    terms = policy_terms(cfg)
    _, metrics = terms(forward.log_prob, forward.entropy, samples)
    assert float(metrics["actor/pg_loss"]) == pytest.approx(float(expected_pg), abs=1e-6)


def test_a_padded_width_normaliser_would_depend_on_the_micro_batching():
    """Why the constant matters: dividing by each micro-batch's own width (the old default)
    changes the loss of the same batch with the micro-batch size."""
    samples, forward = batch()
    loss_mat = (forward.log_prob * samples.tensors.require("advantages")).detach()
    rows = list(range(samples.size))

    def by_width(micro: int) -> float:
        total = 0.0
        for idx, mb in micro_batches(samples, rows, micro):
            part = loss_mat[idx, : mb.response_mask.shape[1]]
            total += (
                float(agg_loss(part, mb.response_mask, "seq-mean-token-sum-norm", num_seqs=mb.size))
                * mb.size
                / len(rows)
            )
        return total

    assert abs(by_width(1) - by_width(16)) > 1e-3
