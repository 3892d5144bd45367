"""Slow, independent references for megarl.algos, and random ragged inputs.

The references loop over sequences and tokens with Python scalars (or 0-dim tensors where a
gradient is wanted) and share no code with megarl.algos. Other test_algos_* modules import them;
the tests at the bottom check the input builders themselves.
"""

from __future__ import annotations

import math

import torch

# ---------------------------------------------------------------------------------------- inputs


def ragged_mask(
    gen: torch.Generator, batch: int, length: int, holes: bool = True, empty_row: bool = True
) -> torch.Tensor:
    """Random right-padded lengths (0..length), optionally holes inside, optionally one empty row."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for i in range(batch):
        n = int(torch.randint(1, length + 1, (1,), generator=gen))
        mask[i, :n] = True
        if holes and n > 2 and float(torch.rand((), generator=gen)) < 0.5:
            j = int(torch.randint(1, n - 1, (1,), generator=gen))
            mask[i, j] = False
    if empty_row and batch > 1:
        mask[int(torch.randint(0, batch, (1,), generator=gen))] = False
    return mask


def valid_positions(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if bool(mask[i, t])]


# ----------------------------------------------------------------------------------- aggregation


def ref_agg(
    loss: list[list], mask: torch.Tensor, mode: str, norm_length: float | None = None
) -> object:
    """loss: nested lists (rows of scalars or 0-dim tensors) of the mask's shape."""
    batch, length = mask.shape
    if mode == "token-mean":
        total, count = 0.0, 0
        for i in range(batch):
            for t in valid_positions(mask, i):
                total = total + loss[i][t]
                count += 1
        return total / max(count, 1)
    seq_values = []
    for i in range(batch):
        pos = valid_positions(mask, i)
        if not pos:
            continue
        s = 0.0
        for t in pos:
            s = s + loss[i][t]
        if mode == "seq-mean-token-sum":
            seq_values.append(s)
        elif mode == "seq-mean-token-mean":
            seq_values.append(s / len(pos))
        elif mode == "seq-mean-token-sum-norm":
            seq_values.append(s / (length if norm_length is None else norm_length))
        else:
            raise AssertionError(mode)
    total = 0.0
    for v in seq_values:
        total = total + v
    return total / max(len(seq_values), 1)


# ---------------------------------------------------------------------------------- policy loss


def ref_ppo_token(old: float, new, adv: float, low: float, high: float, c: float | None):
    """One token's PPO (dual-clip) loss; ``new`` may be a 0-dim tensor (for gradients)."""
    ratio = torch.exp(new - old) if isinstance(new, torch.Tensor) else math.exp(new - old)
    clipped_ratio = min(max(ratio, 1.0 - low), 1.0 + high)
    surrogate = max(-adv * ratio, -adv * clipped_ratio)
    if c is not None and adv < 0:
        surrogate = min(surrogate, -adv * c)
    return surrogate


def ref_ppo_loss(old, new, adv, mask, mode, low=0.2, high=0.2, c=3.0):
    batch, length = mask.shape
    mat = [
        [
            ref_ppo_token(float(old[i, t]), new[i, t], float(adv[i, t]), low, high, c)
            if bool(mask[i, t])
            else 0.0
            for t in range(length)
        ]
        for i in range(batch)
    ]
    return ref_agg(mat, mask, mode)


def ref_gspo_seq_loss(old, new, adv_per_seq, mask, low, high):
    """GSPO as written in the paper: mean over sequences of max(-A s, -A clip(s))."""
    total, n = 0.0, 0
    for i in range(mask.shape[0]):
        pos = valid_positions(mask, i)
        if not pos:
            continue
        log_s = 0.0
        for t in pos:
            log_s = log_s + (new[i, t] - float(old[i, t]))
        s = torch.exp(log_s / len(pos))
        a = adv_per_seq[i]
        total = total + max(-a * s, -a * min(max(s, 1 - low), 1 + high))
        n += 1
    return total / max(n, 1)


# ----------------------------------------------------------------------------------- advantages


def ref_gae(rewards, values, mask, gamma, lam):
    """A_t = sum over later valid tokens k of (gamma lam)^(steps t->k) delta_k (forward sums)."""
    batch, _ = mask.shape
    adv = [[0.0] * mask.shape[1] for _ in range(batch)]
    for i in range(batch):
        pos = valid_positions(mask, i)
        deltas = []
        for j, t in enumerate(pos):
            v_next = float(values[i, pos[j + 1]]) if j + 1 < len(pos) else 0.0
            deltas.append(float(rewards[i, t]) + gamma * v_next - float(values[i, t]))
        for j, t in enumerate(pos):
            adv[i][t] = sum((gamma * lam) ** (k - j) * deltas[k] for k in range(j, len(pos)))
    return adv


def ref_returns_to_go(rewards, mask, gamma):
    out = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i in range(mask.shape[0]):
        pos = valid_positions(mask, i)
        for j, t in enumerate(pos):
            out[i][t] = sum(
                gamma ** (k - j) * float(rewards[i, pos[k]]) for k in range(j, len(pos))
            )
    return out


def ref_whiten(mat, mask, eps=1e-8):
    vals = [mat[i][t] for i in range(mask.shape[0]) for t in valid_positions(mask, i)]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [
        [
            (mat[i][t] - mean) / math.sqrt(var + eps) if bool(mask[i, t]) else 0.0
            for t in range(mask.shape[1])
        ]
        for i in range(mask.shape[0])
    ]


def ref_scores(rewards, mask):
    return [
        sum(float(rewards[i, t]) for t in valid_positions(mask, i)) for i in range(mask.shape[0])
    ]


def ref_group_members(group_ids, mask):
    members: dict = {}
    for i, g in enumerate(group_ids):
        if valid_positions(mask, i):
            members.setdefault(g, []).append(i)
    return members


def ref_grpo_seq(rewards, mask, group_ids, norm_by_std=True, eps=1e-6):
    scores = ref_scores(rewards, mask)
    members = ref_group_members(group_ids, mask)
    adv = [0.0] * len(scores)
    for rows in members.values():
        if len(rows) < 2:
            continue
        xs = [scores[r] for r in rows]
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        for r in rows:
            adv[r] = (scores[r] - mean) / (std + eps) if norm_by_std else scores[r] - mean
    return adv


def ref_rloo_seq(rewards, mask, group_ids):
    scores = ref_scores(rewards, mask)
    members = ref_group_members(group_ids, mask)
    adv = [0.0] * len(scores)
    for rows in members.values():
        for r in rows:
            others = [scores[o] for o in rows if o != r]
            if others:
                adv[r] = scores[r] - sum(others) / len(others)
    return adv


def broadcast_seq(adv_seq, mask):
    return [
        [adv_seq[i] if bool(mask[i, t]) else 0.0 for t in range(mask.shape[1])]
        for i in range(mask.shape[0])
    ]


# ----------------------------------------------------------------------------------------- tests


def test_ragged_mask_has_ragged_lengths_holes_and_an_empty_row():
    gen = torch.Generator().manual_seed(0)
    mask = ragged_mask(gen, 16, 9)
    lengths = mask.sum(dim=1).tolist()
    assert 0 in lengths
    assert len(set(lengths)) > 3
    has_hole = any(
        not bool(mask[i, t]) and bool(mask[i, t + 1]) for i in range(16) for t in range(8)
    )
    assert has_hole


def test_ref_gae_single_token_is_reward_minus_value():
    mask = torch.tensor([[True, False]])
    adv = ref_gae(torch.tensor([[2.0, 9.0]]), torch.tensor([[0.5, 9.0]]), mask, 0.9, 0.8)
    assert adv == [[1.5, 0.0]]
