"""The scalar output layer of a critic or a reward model."""

from __future__ import annotations

import torch


class ValueHead(torch.nn.Module):
    """One scalar per token; replaces the LM output layer of a critic or a reward model
    (replicated across TP; see :mod:`megarl.models.heads`).

    Its signature matches megatron's output layer call ``(hidden, weight=, runtime_gather_output=)``
    and it returns ``(scalars, None)`` like a ColumnParallelLinear.
    """

    def __init__(
        self, hidden_size: int, dtype: torch.dtype, device: torch.device, bias: bool = True
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device)) if bias else None

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None

    @torch.no_grad()
    def fresh_init(self, head) -> None:
        """The start of a head the checkpoint does not hold: zeros, or a seeded normal."""
        if head.fresh_init == "normal":
            # A CPU generator gives the same start on every machine (and every TP rank).
            gen = torch.Generator().manual_seed(head.init_seed)
            w = torch.randn(self.weight.shape, generator=gen, dtype=torch.float32, device="cpu")
            w = w * head.init_std
            self.weight.copy_(w.to(self.weight.dtype))
        else:
            self.weight.zero_()
        if self.bias is not None:
            self.bias.zero_()
