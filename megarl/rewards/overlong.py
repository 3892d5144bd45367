"""Overlong reward shaping (DAPO, Yu et al. 2025, "soft overlong punishment").

A response truncated at the length limit is usually unfinished, and scoring it like a finished
one teaches the policy that length is free. With ``L = max_length`` and a buffer of ``B`` tokens,
a response of ``n`` tokens gets

- 0 when ``n <= L - B``,
- ``(L - B - n) / B * penalty_factor`` inside the buffer (linear, down to ``-penalty_factor``
  at ``n = L``),
- ``-penalty_factor`` beyond ``L`` (only reachable when responses are not truncated at ``L``),

added to its outcome score.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    response_lengths: torch.Tensor, *, max_length: int, buffer_length: int, penalty_factor: float
) -> torch.Tensor:
    """``[N]`` penalties (<= 0) for responses of ``response_lengths`` tokens."""
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"buffer_length must be in (0, {max_length}], got {buffer_length}")
    expected = max_length - buffer_length
    over = (response_lengths.float() - expected).clamp(min=0.0)
    return -(over / buffer_length).clamp(max=1.0) * penalty_factor
