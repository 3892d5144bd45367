"""Log-probabilities of given tokens and entropy from vocabulary-sharded logits.

With tensor parallelism the output layer leaves each rank of the TP group a contiguous slice of
the vocabulary: rank ``k`` holds columns ``[k * shard, (k + 1) * shard)``. Gathering the full
[tokens, vocab] logits on every rank (151,936 columns for Qwen2.5) costs TP times the memory of a
shard plus more for the softmax. Instead each rank reduces its shard to a few numbers per token and
the group all-reduces those:

- ``m``: max logit (all-reduce MAX), for a stable softmax;
- ``S = sum_j exp(z_j - m)`` (all-reduce SUM), so ``log Z = m + log S``;
- ``t``: the target's logit minus ``m`` (all-reduce SUM; only the owning rank adds non-zero);
- ``A = sum_j exp(z_j - m) (z_j - m)`` (all-reduce SUM), so ``H = log S - A / S``.

``log p(target) = t - log S``. The backward needs only the local shard and these per-token
numbers: ``d log p(y) / dz_j = [j == y] - p_j`` and ``dH / dz_j = -p_j (log p_j + H)``, so it has
no communication (each rank's loss is the same replicated value; each rank owns its columns'
gradient). Nothing of vocabulary size is stored for the backward except the input logits
themselves (a reference, not a copy): ``p`` is recomputed there. The local work runs over row
chunks so the temporaries stay at ``chunk_elems`` elements instead of the size of the shard.

Accumulation is in float32 for 16-bit logits (float64 for float64 logits); the outputs have that
dtype and the gradient comes back in the logits' dtype.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor

ProcessGroup: TypeAlias = dist.ProcessGroup

# exp() of anything below this underflows to 0 in fp32 and fp64 alike; clamping -inf logits (masked
# vocabulary) to it turns 0 * -inf = NaN in the entropy into 0 * -1e4 = 0.
_NEG = -1.0e4
DEFAULT_CHUNK_ELEMS = 1 << 25


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_rank_size(group: ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(t: Tensor, op: dist.ReduceOp, group: ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _Chunks:
    """Row chunks of an [N, V] shard and two reusable [rows, V] work buffers for them.

    Reusing the buffers (instead of fresh temporaries per chunk) keeps the extra memory at two
    chunks and, on CPU, saves the page faults of mapping new memory for every chunk.
    """

    def __init__(self, n_rows: int, n_cols: int, chunk_elems: int, like: Tensor, acc: torch.dtype):
        self.n_rows = n_rows
        self.step = max(1, min(n_rows, chunk_elems // max(n_cols, 1)))
        self.a = torch.empty(self.step, n_cols, dtype=acc, device=like.device)
        self.b = torch.empty_like(self.a)

    def __iter__(self):
        for r0 in range(0, self.n_rows, self.step):
            r1 = min(self.n_rows, r0 + self.step)
            yield r0, r1, self.a[: r1 - r0], self.b[: r1 - r0]


def _shifted(z: Tensor, m: Tensor, out: Tensor) -> Tensor:
    """``out = z - m`` (per row) in the accumulation dtype, -inf clamped."""
    return torch.sub(z, m.unsqueeze(-1), out=out).clamp_(min=_NEG)


class _LogProbEntropy(torch.autograd.Function):
    """[N, V_local] logits (+ [N] targets) -> ([N] log p(target), [N] entropy)."""

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        target: Tensor | None,
        group: ProcessGroup | None,
        vocab_start: int,
        n_valid: int,
        want_entropy: bool,
        chunk_elems: int,
    ) -> tuple[Tensor, Tensor]:
        n_rows = logits.shape[0]
        acc = _acc_dtype(logits.dtype)
        z = logits[:, :n_valid]
        if n_valid > 0:
            m = z.amax(dim=-1).to(acc)
        else:
            m = torch.full((n_rows,), float("-inf"), dtype=acc, device=logits.device)
        _all_reduce(m, dist.ReduceOp.MAX, group)
        # A row that is -inf everywhere has no distribution; keep m finite so the rest is NaN-free
        # arithmetic (its S is 0 and its outputs come out -inf / NaN, as they should).
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))

        stats = torch.zeros(3, n_rows, dtype=acc, device=logits.device)  # S, A, t
        if n_valid > 0:
            for r0, r1, buf_a, buf_b in _Chunks(n_rows, n_valid, chunk_elems, logits, acc):
                s = _shifted(z[r0:r1], m[r0:r1], out=buf_a)
                e = torch.exp(s, out=buf_b)
                torch.sum(e, dim=-1, out=stats[0, r0:r1])
                if want_entropy:
                    torch.sum(e.mul_(s), dim=-1, out=stats[1, r0:r1])
            if target is not None:
                local = target - vocab_start
                owned = (local >= 0) & (local < n_valid)
                idx = torch.where(owned, local, torch.zeros_like(local)).unsqueeze(-1)
                t = z.gather(-1, idx).squeeze(-1).to(acc) - m
                stats[2] = torch.where(owned, t, torch.zeros_like(t))
        _all_reduce(stats, dist.ReduceOp.SUM, group)

        log_s = torch.log(stats[0])
        log_prob = stats[2] - log_s
        entropy = log_s - stats[1] / stats[0]
        ctx.save_for_backward(logits, target, m, log_s, entropy)
        ctx.vocab_start = vocab_start
        ctx.n_valid = n_valid
        ctx.chunk_elems = chunk_elems
        ctx.has_target = target is not None
        ctx.want_entropy = want_entropy
        return log_prob, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_prob: Tensor | None, grad_entropy: Tensor | None):
        logits, target, m, log_s, entropy = ctx.saved_tensors
        n_valid = ctx.n_valid
        acc = m.dtype
        n_rows = logits.shape[0]
        g_lp = grad_log_prob if ctx.has_target and grad_log_prob is not None else None
        g_h = grad_entropy if ctx.want_entropy and grad_entropy is not None else None
        grad = torch.zeros_like(logits)
        if n_valid == 0 or (g_lp is None and g_h is None):
            return grad, None, None, None, None, None, None
        zero = torch.zeros(n_rows, dtype=acc, device=logits.device)
        g_lp_acc = zero if g_lp is None else g_lp.to(acc)
        z = logits[:, :n_valid]
        for r0, r1, buf_a, buf_b in _Chunks(n_rows, n_valid, ctx.chunk_elems, logits, acc):
            # log p_j = z_j - m - log S
            log_p = _shifted(z[r0:r1], m[r0:r1], out=buf_a).sub_(log_s[r0:r1].unsqueeze(-1))
            p = torch.exp(log_p, out=buf_b)
            # dL/dz_j = -p_j * (g_lp + g_h * (log p_j + H))  (+ g_lp at the target, below)
            if g_h is None:
                out = p.mul_(g_lp_acc[r0:r1].unsqueeze(-1))
            else:
                out = (
                    log_p.add_(entropy[r0:r1].unsqueeze(-1))
                    .mul_(g_h[r0:r1].to(acc).unsqueeze(-1))
                    .add_(g_lp_acc[r0:r1].unsqueeze(-1))
                    .mul_(p)
                )
            grad[r0:r1, :n_valid] = out.neg_()
        if g_lp is not None:
            local = target - ctx.vocab_start
            owned = (local >= 0) & (local < n_valid)
            idx = torch.where(owned, local, torch.zeros_like(local)).unsqueeze(-1)
            src = torch.where(owned, g_lp, torch.zeros_like(g_lp)).to(grad.dtype).unsqueeze(-1)
            grad[:, :n_valid].scatter_add_(-1, idx, src)
        return grad, None, None, None, None, None, None


def _run(
    logits_shard: Tensor,
    target_ids: Tensor | None,
    group: ProcessGroup | None,
    vocab_size: int | None,
    want_entropy: bool,
    chunk_elems: int,
) -> tuple[Tensor, Tensor]:
    rank, world = _group_rank_size(group)
    shard = logits_shard.shape[-1]
    total = shard * world
    if vocab_size is None:
        vocab_size = total
    if not 0 < vocab_size <= total:
        raise ValueError(f"vocab_size {vocab_size} must be in (0, {total}] (= {world} x {shard})")
    vocab_start = rank * shard
    n_valid = max(0, min(shard, vocab_size - vocab_start))
    lead_shape = logits_shard.shape[:-1]
    flat = logits_shard.reshape(-1, shard)
    target_flat = None
    if target_ids is not None:
        if target_ids.shape != lead_shape:
            raise ValueError(
                f"target_ids shape {tuple(target_ids.shape)} != logits shape without the vocab "
                f"dim {tuple(lead_shape)}"
            )
        if target_ids.dtype.is_floating_point or target_ids.dtype == torch.bool:
            raise TypeError(f"target_ids must be an integer tensor, got {target_ids.dtype}")
        if target_ids.numel() and (
            int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size
        ):
            raise ValueError(
                f"target_ids must be in [0, {vocab_size}), got range "
                f"[{int(target_ids.min())}, {int(target_ids.max())}]"
            )
        target_flat = target_ids.reshape(-1).long()
    log_prob, entropy = _LogProbEntropy.apply(
        flat, target_flat, group, vocab_start, n_valid, want_entropy, chunk_elems
    )
    return log_prob.reshape(lead_shape), entropy.reshape(lead_shape)


def vocab_parallel_log_probs_and_entropy(
    logits_shard: Tensor,
    target_ids: Tensor,
    group: ProcessGroup | None,
    *,
    vocab_size: int | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> tuple[Tensor, Tensor]:
    """Both at once (one pass, two small all-reduces). See :func:`vocab_parallel_log_probs`."""
    return _run(logits_shard, target_ids, group, vocab_size, True, chunk_elems)


def vocab_parallel_log_probs(
    logits_shard: Tensor,
    target_ids: Tensor,
    group: ProcessGroup | None,
    *,
    vocab_size: int | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> Tensor:
    """``log softmax(logits)[..., target]`` from this rank's vocabulary shard ``[..., V / tp]``.

    ``group`` is the tensor-parallel group whose ranks hold the shards in rank order; ``None``
    means the logits hold the whole vocabulary (no communication). ``vocab_size`` is the real
    vocabulary size when the sharded one is padded (Megatron pads to a multiple of TP x 128):
    columns at or beyond it are ignored. ``target_ids`` has the logits' shape without the last dim.
    Every rank of the group gets the same result; gradients flow to this rank's shard.
    """
    return _run(logits_shard, target_ids, group, vocab_size, False, chunk_elems)[0]


def vocab_parallel_entropy(
    logits_shard: Tensor,
    group: ProcessGroup | None,
    *,
    vocab_size: int | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> Tensor:
    """Entropy of ``softmax(logits)`` per position from this rank's vocabulary shard.

    Same conventions as :func:`vocab_parallel_log_probs`.
    """
    return _run(logits_shard, None, group, vocab_size, True, chunk_elems)[1]


def log_probs_from_logits(logits: Tensor, ids: Tensor, *, vocab_size: int | None = None) -> Tensor:
    """TP1: log-probabilities of ``ids`` under the full-vocabulary ``logits``."""
    return vocab_parallel_log_probs(logits, ids, None, vocab_size=vocab_size)


def entropy_from_logits(logits: Tensor, *, vocab_size: int | None = None) -> Tensor:
    """TP1: entropy of the full-vocabulary ``logits`` per position."""
    return vocab_parallel_entropy(logits, None, vocab_size=vocab_size)


@torch.no_grad()
def vocab_parallel_is_argmax(
    logits_shard: Tensor, target_ids: Tensor, group: ProcessGroup | None, *, vocab_size: int
) -> Tensor:
    """Whether each target is the most likely token (ties count), from this rank's vocabulary
    shard: the per-token accuracy of teacher forcing. Same conventions as
    :func:`vocab_parallel_log_probs`; one all-reduce of twice the targets' size, no gradient."""
    rank, _ = _group_rank_size(group)
    shard = logits_shard.shape[-1]
    vocab_start = rank * shard
    n_valid = max(0, min(shard, vocab_size - vocab_start))
    acc = _acc_dtype(logits_shard.dtype)
    lead = logits_shard.shape[:-1]
    z = logits_shard[..., :n_valid]
    best = torch.full(lead, float("-inf"), dtype=acc, device=logits_shard.device)
    target = torch.full_like(best, float("-inf"))
    if n_valid > 0:
        best = z.amax(dim=-1).to(acc)
        local = target_ids.to(logits_shard.device).long() - vocab_start
        owned = (local >= 0) & (local < n_valid)
        idx = torch.where(owned, local, torch.zeros_like(local)).unsqueeze(-1)
        picked = z.gather(-1, idx).squeeze(-1).to(acc)
        target = torch.where(owned, picked, target)
    both = torch.stack([best, target])
    _all_reduce(both, dist.ReduceOp.MAX, group)
    return both[1] >= both[0]
