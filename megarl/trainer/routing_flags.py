"""Per response token of a step's samples, whether the trainer's routers chose the rollout's
experts (actor.router_replay): the rollout-vs-trainer mismatch of an MoE model is reported again
over the *agreed* tokens and over the *flipped* ones (megarl.rollout.mismatch).

A response token's logprob comes from the position before it; the token is *flipped* when at
that position some MoE layer's router, in the forward that gave the trainer's logprob, chose
(as its own top-k, whether replayed or not) another expert set than the rollout recorded;
*agreed* when every layer chose the rollout's; *unrecorded* when the rollout recorded no expert
there (counted in neither).

The routers run on every pipeline stage (each its own layers) and, under sequence parallelism,
each tensor-parallel rank routes its share of the positions, while the logprobs are on the last
stage. So each rank marks the positions its own routers saw, micro-batch by micro-batch
(:class:`~megarl.models.router_replay.TokenFlags`, left in the micro-batch's dict by the
forward), puts them in response space for its samples, and one MAX all-reduce over the
model-parallel group (TP x PP, the ranks holding the same samples) combines them: flipped on any
stage or share is flipped, else recorded on any is agreed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megarl import parallel, platform
from megarl.models.forward import ROUTING_FLAGS
from megarl.models.logprobs import positions_from
from megarl.models.router_replay import TokenFlags
from megarl.trainer.batch import Samples

UNRECORDED, AGREED, FLIPPED = 0, 1, 2


def flags_buffer(samples: Samples) -> torch.Tensor | None:
    """An ``[N, R]`` buffer of :data:`UNRECORDED` for a pass over ``samples`` to fill (on the
    collectives' device: the model-parallel group combines it), or None when the samples carry
    no recorded routes (nothing to split by)."""
    if samples.routes is None:
        return None
    shape = tuple(samples.response_mask.shape)
    return torch.zeros(shape, dtype=torch.int32, device=platform.collective_device())


def position_codes(flags: TokenFlags, shape: tuple[int, int]) -> torch.Tensor:
    """``[b, L]`` codes of one micro-batch's positions as this rank's routers marked them."""
    codes = torch.where(flags.recorded, AGREED, UNRECORDED)
    return torch.where(flags.flipped, FLIPPED, codes).reshape(shape).to(torch.int32)


def fill_response_flags(
    out: torch.Tensor,
    micro_batches: Sequence[tuple[Sequence[int], Samples]],
    inputs: Sequence[Mapping[str, Any]],
) -> None:
    """Write each micro-batch's response-token codes (its rows of ``out``) from the flags its
    forward left in its input dict. Each rank writes what its routers saw; combine them with
    :func:`combine_over_model_parallel`."""
    for (rows, mb), batch in zip(micro_batches, inputs, strict=True):
        flags = batch.get(ROUTING_FLAGS)
        if flags is None:  # no recorded routes in this micro-batch
            continue
        codes = position_codes(flags, tuple(mb.input_ids.shape))
        width = mb.response_mask.shape[1]
        positions = positions_from(mb.starts.cpu(), width, mb.input_ids.shape[1])
        out[list(rows), :width] = codes.gather(1, positions).to(out.device)


def combine_over_model_parallel(out: torch.Tensor) -> torch.Tensor:
    """``out`` with every stage's and tensor-parallel share's codes (their maximum; in place, a
    collective over the model-parallel group)."""
    group = parallel.mp_group_if_split()
    if group is not None:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


__all__ = [
    "AGREED",
    "FLIPPED",
    "UNRECORDED",
    "combine_over_model_parallel",
    "fill_response_flags",
    "flags_buffer",
    "position_codes",
]
