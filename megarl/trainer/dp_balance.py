"""Re-deal a step's samples over the data-parallel ranks so each trains about the same tokens.

Each DP rank rolls out its own prompts; with long-tailed response lengths one rank can hold far
more tokens than another and the others wait for it at every gradient reduction. After the
rollout (and its scores) every rank all-gathers the step's samples of its DP group, computes the
same assignment of whole prompt groups (:func:`megarl.data.token_balance.balance_groups`: equal
group counts, heaviest rank <= mean + largest group) and keeps its share. Ranks of one DP replica
(its TP/PP ranks) hold the same samples and take the same share.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypedDict

import torch
import torch.distributed as dist

from megarl import parallel
from megarl.data.token_balance import balance_groups, imbalance
from megarl.trainer.batch import Samples, padded_routes
from megarl.trainer.token_tensors import TokenTensors

# The imbalance of the rollout as each rank drew it; the trained one (after the re-deal) is the
# step's perf/dp_token_imbalance (megarl.run.steps).
BEFORE = "perf/dp_token_imbalance_rollout"


class HostRow(TypedDict):
    """One sample as a plain record on the host, to move between ranks (an all-gather)."""

    ids: torch.Tensor  # prompt + response tokens, unpadded
    prompt_len: int
    mask: list[int]  # the response's loss mask
    group: Hashable
    tensors: TokenTensors  # the sample's per-token tensors, [1, its response length]
    score: torch.Tensor
    routes: torch.Tensor | None  # actor.router_replay: [tokens, layers, k], unpadded


def host_rows(samples: Samples, scores: torch.Tensor) -> list[HostRow]:
    """One plain record per sample (host tensors, unpadded), for the all-gather."""
    lens = samples.seq_lens().tolist()
    resp = samples.response_lens.tolist()
    ids = samples.input_ids.cpu()
    tensors = samples.tensors.to("cpu")
    host_scores = scores.cpu()
    mask = samples.response_mask.cpu()
    return [
        {
            "ids": ids[i, : lens[i]],
            "prompt_len": lens[i] - resp[i],
            "mask": mask[i, : resp[i]].tolist(),  # environment tokens of a trajectory are 0
            "group": samples.group_ids[i],
            "tensors": tensors.select(torch.tensor([i], device="cpu"), max(1, resp[i])),
            "score": host_scores[i],
            "routes": None if samples.routes is None else samples.routes[i, : lens[i]],
        }
        for i in range(samples.size)
    ]


def samples_of_rows(rows: list[HostRow], pad_id: int, device: torch.device) -> Samples:
    """The rows back as Samples on ``device`` (padded to the longest), in the order given."""
    prompts = [r["ids"][: r["prompt_len"]].tolist() for r in rows]
    responses = [r["ids"][r["prompt_len"] :].tolist() for r in rows]
    samples = Samples.from_sequences(
        prompts,
        responses,
        [r["group"] for r in rows],
        pad_id,
        device,
        masks=[r["mask"] for r in rows],
    )
    width = samples.response_mask.shape[1]
    samples.tensors = TokenTensors.concat([r["tensors"] for r in rows], width).to(device)
    routes = [r["routes"] for r in rows]
    if rows and all(r is not None for r in routes):
        samples.routes = padded_routes(
            [r for r in routes if r is not None], int(samples.input_ids.shape[1])
        )
    return samples


def balance_over_data_parallel(
    samples: Samples, scores: torch.Tensor, pad_id: int
) -> tuple[Samples, torch.Tensor, dict[str, float]]:
    """This rank's token-balanced share of its DP group's samples and scores, and the token
    imbalance (heaviest rank / mean - 1) of the rollout as drawn. Collective over the DP group.

    Left as it is (metrics still reported) when the groups cannot be dealt evenly (a group count
    not divisible by the DP size, or groups of unequal sizes: a rank would train more samples),
    or when the deal would not lower the heaviest rank."""
    group = parallel.dp_group()
    size = dist.get_world_size(group)
    if size == 1:
        return samples, scores, {}
    gathered: list[list[HostRow] | None] = [None] * size
    dist.all_gather_object(gathered, host_rows(samples, scores), group=group)
    rows = [row for part in gathered for row in (part or [])]
    rank_tokens = [sum(int(r["ids"].numel()) for r in part or []) for part in gathered]
    before = imbalance(rank_tokens)
    members: dict[tuple[int, Hashable], list[int]] = {}
    index = 0
    for source, part in enumerate(gathered):
        for r in part or []:
            members.setdefault((source, r["group"]), []).append(index)
            index += 1
    keys = list(members)
    sizes = {len(m) for m in members.values()}
    if len(keys) % size or len(sizes) > 1:
        return samples, scores, {BEFORE: before}
    group_tokens = [sum(int(rows[i]["ids"].numel()) for i in members[k]) for k in keys]
    plan = balance_groups(group_tokens, size)
    if max(plan.tokens) >= max(rank_tokens):  # no better than as drawn: nothing moves
        return samples, scores, {BEFORE: before}
    mine = [i for g in plan.ranks[parallel.dp_rank()] for i in members[keys[g]]]
    device = samples.input_ids.device
    balanced = samples_of_rows([rows[i] for i in mine], pad_id, device)
    new_scores = torch.stack([rows[i]["score"] for i in mine]).to(scores.device)
    return (
        balanced,
        new_scores,
        {BEFORE: before},
    )
