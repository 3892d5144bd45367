"""The rollout-vs-trainer logprob mismatch: how far the rollout engine's logprob of each sampled
token is from the trainer's, as step metrics (``rollout/logprob_diff_mean``, ``_max``).

An MoE model reports them again under ``rollout/moe_*``: a router choice that flips between the
rollout and the trainer moves a token's logprob far more than a dense model's rounding does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl import platform
from megarl.metrics import Reduce

# How the metrics of :func:`logprob_mismatch` combine over ranks (the rest: mean); they are
# world-wide already, so every rank reports the same values.
LOGPROB_MISMATCH_REDUCTIONS = {
    "rollout/logprob_diff_max": Reduce.MAX,
    "rollout/moe_logprob_diff_max": Reduce.MAX,
}


def logprob_mismatch(diffs: torch.Tensor, is_moe: bool) -> dict[str, float]:
    """Mean and max of ``diffs`` (this rank's |rollout - trainer| logprobs, one per response
    token, flat) over the whole world (a collective)."""
    flat = diffs.reshape(-1)
    total, peak_value = (flat.sum().item(), flat.max().item()) if flat.numel() else (0.0, 0.0)
    device = platform.collective_device()
    sums = torch.tensor([total, float(flat.numel())], dtype=torch.float64, device=device)
    peak = torch.tensor([peak_value], dtype=torch.float64, device=device)
    dist.all_reduce(sums)  # every rank counts its DP rank's tokens tp*pp times: still a mean
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    out = {
        "rollout/logprob_diff_mean": float(sums[0] / max(sums[1].item(), 1.0)),
        "rollout/logprob_diff_max": float(peak.item()),
    }
    if is_moe:
        out |= {k.replace("rollout/", "rollout/moe_"): v for k, v in out.items()}
    return out
