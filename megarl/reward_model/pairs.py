"""Preference pairs as model input: chosen and rejected of a pair always share a micro-batch.

Rows ``2i`` and ``2i + 1`` of a micro-batch are pair ``i``'s chosen and rejected sequences
(prompt + response), right padded. Pairs are ordered by their longer sequence before being cut
into micro-batches, so padding stays small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PairMicroBatch:
    input_ids: torch.Tensor  # [2P, L]
    seq_lens: torch.Tensor  # [2P]

    @property
    def pairs(self) -> int:
        return int(self.input_ids.shape[0]) // 2


def pad_sequences(
    sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[N, max_len]`` ids and the ``[N]`` lengths, on ``device``."""
    lens = [len(s) for s in sequences]
    if min(lens) < 1:
        raise ValueError("every sequence needs at least one token")
    width = max(lens)
    rows = [list(s) + [pad_id] * (width - len(s)) for s in sequences]
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(lens, dtype=torch.long, device=device),
    )


def pair_micro_batches(
    items, pairs_per_micro_batch: int, pad_id: int, device: torch.device | str
) -> list[PairMicroBatch]:
    """``items`` (PreferenceItem: prompt_ids, chosen_ids, rejected_ids) -> micro-batches on
    ``device`` (the model's)."""
    seqs = [
        (list(it.prompt_ids) + list(it.chosen_ids), list(it.prompt_ids) + list(it.rejected_ids))
        for it in items
    ]
    order = sorted(range(len(seqs)), key=lambda i: (max(map(len, seqs[i])), i))
    out = []
    for start in range(0, len(order), pairs_per_micro_batch):
        chunk = order[start : start + pairs_per_micro_batch]
        ids, lens = pad_sequences([s for i in chunk for s in seqs[i]], pad_id, device)
        out.append(PairMicroBatch(ids, lens))
    return out
