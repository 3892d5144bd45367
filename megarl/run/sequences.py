"""Micro-batches of the supervised trainers (SFT, DPO): prompt + response rows, right padded, and
the response tokens each row learns.

A row's response token ``j`` is predicted at sequence position ``prompt_len - 1 + j``; the model's
output layer projects only those positions (``positions``), and losses work in response space
``[rows, max_response_len]`` with a 0/1 ``loss_mask`` (0 past a row's end, and on response tokens
that are context only, such as user turns between assistant turns).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megarl.models.logprobs import positions_from
from megarl.models.packing import token_counts


@dataclass
class TokenRows:
    input_ids: Tensor  # [b, L] right padded
    prompt_lens: Tensor  # [b]
    seq_lens: Tensor  # [b] prompt + response
    loss_mask: Tensor  # [b, R] float 0/1

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def positions(self) -> Tensor:
        """``[b, R]`` positions whose outputs predict response token j of each row (past a row's
        end they repeat its last position; masked)."""
        return positions_from(
            self.prompt_lens - 1, self.loss_mask.shape[1], self.input_ids.shape[1]
        )

    def tokens(self) -> Tensor:
        """``[b]`` trained tokens per row."""
        return self.loss_mask.sum(-1)

    def schedule_inputs(self, packing: bool) -> dict[str, Tensor]:
        """What :func:`megarl.models.forward.run_schedule` takes for these rows (with
        ``packing``, one pack of them)."""
        out: dict[str, Tensor] = {"input_ids": self.input_ids, "positions": self.positions()}
        if packing:
            out["seq_lens"] = self.seq_lens
        return out


def token_rows(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device | str,
) -> TokenRows:
    """Rows padded on the host, made on ``device`` (the model's) in one copy each."""
    lens = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    if min(len(p) for p in prompts) < 1:
        raise ValueError("every row needs a prompt of at least one token")
    width = max(lens)
    resp_width = max(1, max(len(r) for r in responses))
    ids = [
        [*p, *r] + [pad_id] * (width - n) for p, r, n in zip(prompts, responses, lens, strict=True)
    ]
    mask = [list(m) + [0] * (resp_width - len(m)) for m in masks]
    return TokenRows(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.long, device=device),
        loss_mask=torch.tensor(mask, dtype=torch.float32, device=device),
    )


def length_groups(
    lengths: Sequence[int], size: int, max_tokens: int | None = None, packed: bool = True
) -> list[list[int]]:
    """Indices of ``lengths`` in groups (micro-batches) after sorting by length, so padding stays
    small: ``size`` per group or, with ``max_tokens``, as many as fit that token budget (at least
    one each; packed groups count their real tokens, padded ones rows x the longest)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        candidate = [*current, i]
        if max_tokens is None:
            over = len(candidate) > size
        else:
            over = token_counts([lengths[c] for c in candidate], packed) > max_tokens
        if current and over:
            groups.append(current)
            candidate = [i]
        current = candidate
    if current:
        groups.append(current)
    return groups
