"""The rollout-vs-trainer logprob mismatch: how far the rollout engine's logprob of each sampled
token is from the trainer's, as step metrics (``rollout/logprob_diff_mean``, ``_max``).

An MoE model reports them again under ``rollout/moe_*``: a router choice that flips between the
rollout and the trainer moves a token's logprob far more than a dense model's rounding does. With
the rollout's routes recorded (actor.router_replay) they are split by token: ``..._agreed`` over
the tokens whose experts the trainer's routers chose as the rollout did at every MoE layer,
``..._flipped`` over the others (megarl.trainer.routing_flags), and
``rollout/moe_flipped_tokens`` is the flipped share of those tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl import platform
from megarl.metrics import Reduce

# How the metrics of :func:`logprob_mismatch` combine over ranks (the rest: mean); they are
# world-wide already, so every rank reports the same values.
SPLITS = ("agreed", "flipped")
LOGPROB_MISMATCH_REDUCTIONS = {
    "rollout/logprob_diff_max": Reduce.MAX,
    "rollout/moe_logprob_diff_max": Reduce.MAX,
    **{f"rollout/moe_logprob_diff_max_{split}": Reduce.MAX for split in SPLITS},
}


def _sum_count_peak(values: torch.Tensor) -> tuple[float, float, float]:
    if not values.numel():
        return 0.0, 0.0, 0.0
    return values.sum().item(), float(values.numel()), values.max().item()


def logprob_mismatch(
    diffs: torch.Tensor,
    is_moe: bool,
    agreed: torch.Tensor | None = None,
    flipped: torch.Tensor | None = None,
) -> dict[str, float]:
    """Mean and max of ``diffs`` (this rank's |rollout - trainer| logprobs, one per response
    token, flat) over the whole world (a collective); for an MoE model also over the tokens
    ``agreed`` and ``flipped`` mark (bool, like ``diffs``; None: none here), reported when some
    rank has any."""
    flat = diffs.reshape(-1)
    parts = [flat]
    if is_moe:  # every MoE rank adds these slots, whether it has routes or not
        none = torch.zeros_like(flat, dtype=torch.bool)
        for mask in (agreed, flipped):
            parts.append(flat[(none if mask is None else mask).reshape(-1)])
    stats = [_sum_count_peak(p) for p in parts]
    device = platform.collective_device()
    sums = torch.tensor(
        [v for s, n, _ in stats for v in (s, n)], dtype=torch.float64, device=device
    )
    peak = torch.tensor([p for *_, p in stats], dtype=torch.float64, device=device)
    dist.all_reduce(sums)  # every rank counts its DP rank's tokens tp*pp times: still a mean
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    totals, peaks = sums.tolist(), peak.tolist()
    out = {
        "rollout/logprob_diff_mean": totals[0] / max(totals[1], 1.0),
        "rollout/logprob_diff_max": peaks[0],
    }
    if is_moe:
        out |= {k.replace("rollout/", "rollout/moe_"): v for k, v in out.items()}
        recorded = totals[3] + totals[5]
        if recorded:
            for k, split in enumerate(SPLITS, start=1):
                out[f"rollout/moe_logprob_diff_mean_{split}"] = totals[2 * k] / max(
                    totals[2 * k + 1], 1.0
                )
                out[f"rollout/moe_logprob_diff_max_{split}"] = peaks[k]
            out["rollout/moe_flipped_tokens"] = totals[5] / recorded
    return out
