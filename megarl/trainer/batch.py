"""Rollout samples as padded tensors, and the map between sequence positions and response tokens.

A sample is ``prompt + response``, right padded to the longest sample. Per-token quantities of the
model (logprobs, values) come at *positions*: position ``p`` predicts token ``p + 1``, so response
token ``j`` of a sample is predicted at position ``len(prompt) - 1 + j``. Algorithms work in
*response space* ``[samples, max_response_len]`` with a 0/1 mask. A step's rollout reaches the
update as a :class:`StepBatch`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from megarl.models.packing import token_counts
from megarl.trainer.token_tensors import TokenTensors


@dataclass
class Samples:
    input_ids: torch.Tensor  # [N, L] right padded
    prompt_lens: torch.Tensor  # [N]
    response_lens: torch.Tensor  # [N]
    group_ids: list[Hashable]  # prompt uid per sample (GRPO groups)
    # response space [N, R]
    response_mask: torch.Tensor
    # per-token tensors between the step's phases, each filled by one phase
    tensors: TokenTensors = field(default_factory=TokenTensors)
    # actor.router_replay: [N, L, MoE layers, top_k] experts the rollout routed each token to
    # (int16, host memory, -1: none); None without replay
    routes: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def starts(self) -> torch.Tensor:
        return self.prompt_lens - 1

    def seq_lens(self) -> torch.Tensor:
        return self.prompt_lens + self.response_lens

    @classmethod
    def from_sequences(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        group_ids: Sequence[Hashable],
        pad_id: int,
        device: torch.device | str,
        masks: Sequence[Sequence[float]] | None = None,
    ) -> Samples:
        """Padded on the host as lists, then made on ``device`` (the model's) in one copy each.
        ``masks``: per response token, 1 where it is trained (default: every response token; a
        multi-turn trajectory's environment tokens get 0)."""
        lens = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
        max_len = max(lens)
        max_resp = max(1, max(len(r) for r in responses))
        rows = [
            [*p, *r] + [pad_id] * (max_len - n)
            for p, r, n in zip(prompts, responses, lens, strict=True)
        ]
        if masks is None:
            mask = [[1.0] * len(r) + [0.0] * (max_resp - len(r)) for r in responses]
        else:
            mask = [[float(x) for x in m] + [0.0] * (max_resp - len(m)) for m in masks]
            if any(len(m) != len(r) for m, r in zip(masks, responses, strict=True)):
                raise ValueError("every response mask must be as long as its response")
        return cls(
            input_ids=torch.tensor(rows, dtype=torch.long, device=device),
            prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device),
            response_lens=torch.tensor(
                [len(r) for r in responses], dtype=torch.long, device=device
            ),
            group_ids=list(group_ids),
            response_mask=torch.tensor(mask, dtype=torch.float32, device=device),
        )

    def select(self, rows: Sequence[int]) -> Samples:
        """A subset of samples, trimmed to its own longest sequence and response."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.input_ids.device)
        seq_len = int(self.seq_lens()[idx].max())
        resp_len = max(1, int(self.response_lens[idx].max()))
        return Samples(
            input_ids=self.input_ids[idx, :seq_len],
            prompt_lens=self.prompt_lens[idx],
            response_lens=self.response_lens[idx],
            group_ids=[self.group_ids[i] for i in idx.tolist()],
            response_mask=self.response_mask[idx, :resp_len],
            tensors=self.tensors.select(idx, resp_len),
            routes=None if self.routes is None else self.routes[idx.cpu(), :seq_len],
        )


def padded_routes(routes: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Each sample's recorded experts (``[tokens, layers, k]``) in one ``[N, width, layers, k]``
    host tensor, -1 past a sample's end."""
    layers, k = routes[0].shape[1:]
    out = torch.full((len(routes), width, layers, k), -1, dtype=torch.int16, device="cpu")
    for i, r in enumerate(routes):
        out[i, : r.shape[0]] = r[:width]
    return out


def micro_batches(
    samples: Samples,
    rows: Sequence[int],
    micro_batch_size: int,
    max_tokens: int | None = None,
    packed: bool = False,
    groups_together: bool = False,
) -> list[tuple[list[int], Samples]]:
    """Split ``rows`` into micro-batches after sorting by length, so padding stays small.

    By count (``micro_batch_size``) or, with ``max_tokens``, by a token budget per micro-batch
    (at least one sample each): padded tokens (rows x longest), or with ``packed`` the real
    tokens the pack holds. ``groups_together``: the rows of a prompt group stay next to each
    other (groups ordered by their shortest row), so a micro-batch holds whole groups where its
    size allows: what a shared-prompt pack (actor.share_prompts) saves on.
    """
    lens = samples.seq_lens().tolist()  # one device-to-host copy, not one per row
    if groups_together:
        shortest: dict[Hashable, tuple[int, int]] = {}
        for r in rows:
            g = samples.group_ids[r]
            shortest[g] = min(shortest.get(g, (lens[r], r)), (lens[r], r))
        ordered = sorted(rows, key=lambda r: (shortest[samples.group_ids[r]], lens[r], r))
    else:
        ordered = sorted(rows, key=lambda r: (lens[r], r))
    groups: list[list[int]] = []
    current: list[int] = []
    for r in ordered:
        candidate = [*current, r]
        too_many = len(candidate) > micro_batch_size if max_tokens is None else False
        too_long = (
            max_tokens is not None
            and token_counts([int(lens[c]) for c in candidate], packed) > max_tokens
        )
        if current and (too_many or too_long):
            groups.append(current)
            candidate = [r]
        current = candidate
    if current:
        groups.append(current)
    return [(g, samples.select(g)) for g in groups]


@dataclass
class StepBatch:
    """This rank's share of one step, as the rollout hands it to the update: the samples with
    their outcome scores, and what the step logs about how they were drawn."""

    # prompt + response rows; tensors: rollout_log_prob, token_level_scores, and old_log_prob
    # once the actor has scored them
    samples: Samples
    scores: torch.Tensor  # [N] outcome score per sample
    finish_reasons: list[str]  # per sample drawn (the rollout engine's "stop" / "length")
    reward_metrics: dict[str, float]  # the reward sources' metrics (this rank's means)
