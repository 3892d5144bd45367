"""Sequence packing: a micro-batch of right-padded rows run as one row of their real tokens.

A padded micro-batch ``[b, L]`` spends compute on ``b * L`` tokens, most of them padding when
response lengths have a long tail. Packed, the ``b`` sequences are laid end to end in one row of
``sum(len_i)`` tokens (plus at most ``multiple - 1`` pad tokens so sequence parallelism can split
it evenly). Attention must not cross sequences and rotary positions restart at 0 for each
sequence; both follow from the cumulative sequence lengths handed to megatron as
``PackedSeqParams`` in the THD layout:

- with Transformer Engine (GPU) its fused attention reads ``cu_seqlens`` natively;
- on the local spec (CPU) :class:`megarl.models.attention.SDPACoreAttention` runs causal SDPA on
  each sequence of the pack (block-diagonal causal masking), and megatron's own THD rotary path
  restarts positions per sequence.

The model's output layer projects only the positions a loss needs
(:func:`megarl.models.forward.output_positions`): :func:`packed_positions` maps the padded
batch's ``[b, P]`` positions into the pack, so the output has the padded run's ``[b, P, ...]``
shape and every loss is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # [1, T] the sequences end to end, T a multiple of the SP split
    position_ids: torch.Tensor  # [1, T] per-sequence positions 0 .. len_i - 1
    # [n + 1] int32 boundaries of the n segments: the b sequences, then the pad tail if any
    cu_seqlens: torch.Tensor
    max_seqlen: int
    offsets: torch.Tensor  # [b] where each sequence starts in the pack
    lengths: torch.Tensor  # [b] each sequence's real length

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def seq_params(self):
        """megatron's ``PackedSeqParams`` (THD layout) describing this pack."""
        return thd_params(self.cu_seqlens, self.max_seqlen)


def thd_params(cu_seqlens: torch.Tensor, max_seqlen: int):
    """megatron's ``PackedSeqParams`` in the THD layout: segments at ``cu_seqlens``, the same for
    queries and keys."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )


def pack(input_ids: torch.Tensor, seq_lens: torch.Tensor, multiple: int = 1) -> PackedBatch:
    """The rows of ``input_ids`` (``[b, L]``, right padded, real lengths ``seq_lens``) packed into
    one row whose length is a multiple of ``multiple``.

    The pad tail (token 0) is a segment of its own: no sequence attends to it and its outputs are
    never selected.
    """
    device = input_ids.device
    lengths = seq_lens.to(device=device, dtype=torch.long)
    if lengths.numel() != input_ids.shape[0]:
        raise ValueError(f"{lengths.numel()} sequence lengths for {input_ids.shape[0]} rows")
    if bool((lengths < 1).any()) or bool((lengths > input_ids.shape[1]).any()):
        raise ValueError(f"sequence lengths must lie in [1, {input_ids.shape[1]}]: {lengths}")
    width = input_ids.shape[1]
    real = torch.arange(width, device=device).unsqueeze(0) < lengths.unsqueeze(1)  # [b, L]
    tokens = input_ids[real]  # row-major: sequence after sequence
    positions = torch.arange(width, device=device).unsqueeze(0).expand_as(input_ids)[real]
    total = int(tokens.numel())
    tail = -total % multiple
    segment_lens = lengths.tolist() + ([tail] if tail else [])
    if tail:
        tokens = torch.cat([tokens, tokens.new_zeros(tail)])
        positions = torch.cat([positions, torch.arange(tail, device=device)])
    cu = torch.zeros(len(segment_lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.tensor(segment_lens, dtype=torch.int32, device=device).cumsum(0)
    offsets = cu[: lengths.numel()].to(torch.long)
    return PackedBatch(
        input_ids=tokens.unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        cu_seqlens=cu,
        max_seqlen=max(segment_lens),
        offsets=offsets,
        lengths=lengths,
    )


def packed_values(
    values: torch.Tensor, seq_lens: torch.Tensor, multiple: int = 1, fill: int = 0
) -> torch.Tensor:
    """Per-token ``values`` of a padded batch (``[b, L, ...]``) in the order :func:`pack` lays
    the tokens out (``[T, ...]``, the pad tail filled with ``fill``)."""
    width = values.shape[1]
    lengths = seq_lens.to(device=values.device, dtype=torch.long)
    real = torch.arange(width, device=values.device).unsqueeze(0) < lengths.unsqueeze(1)
    tokens = values[real]
    tail = -int(tokens.shape[0]) % multiple
    if tail:
        tokens = torch.cat([tokens, tokens.new_full((tail, *tokens.shape[1:]), fill)])
    return tokens


def packed_positions(packed: PackedBatch, positions: torch.Tensor) -> torch.Tensor:
    """``[b, P]`` positions of the padded batch as indices into the pack.

    A position past its sequence's end (a padded batch's filler, masked by the caller) is clamped
    to that sequence's last token, so it never reads another sequence or the pad tail.
    """
    lengths = packed.lengths.to(positions.device).unsqueeze(1)
    offsets = packed.offsets.to(positions.device).unsqueeze(1)
    return torch.minimum(positions, lengths - 1) + offsets


def all_positions(input_ids: torch.Tensor) -> torch.Tensor:
    """``[b, L]`` every position of a padded batch (for outputs at all positions from a pack)."""
    width = input_ids.shape[1]
    return torch.arange(width, device=input_ids.device).unsqueeze(0).expand(input_ids.shape[0], -1)


def token_counts(seq_lens: list[int], packed: bool) -> int:
    """Tokens a micro-batch of these sequences puts through the model: their sum packed, rows
    times the longest padded."""
    if not seq_lens:
        return 0
    return sum(seq_lens) if packed else len(seq_lens) * max(seq_lens)
