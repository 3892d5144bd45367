"""torch's fused AdamW kernel inside megatron's optimizer, where megatron falls back to torch's Adam.

Without Transformer Engine or apex (always on CPU, and on GPUs without either) megatron-core
builds ``torch.optim.AdamW`` with torch's default implementation, which on CPU is the
single-tensor loop: for every parameter a chain of element-wise passes (``lerp_``, ``mul_``,
``addcmul_``, ``sqrt``, ``div``, ``addcdiv_``) over the whole fp32 state, two of them through
temporaries the size of the parameter. On SmolLM2-135M, in one run on 2 CPU cores, the optimizer
step (clipping included) took 0.45 s of a 7.5 s training step, and 0.21 s fused; the temporaries
of the 28M-element embedding are page-faulted afresh every step. torch's fused
kernel (``fused=True``, CPU and CUDA since torch 2.4) makes one pass per parameter with no
temporary. It is what transformers' ``Trainer`` uses by default (``adamw_torch_fused``), so a
megarl run and a TRL run of the same recipe now take the same optimizer step; the two
implementations differ by float rounding only (0.37 fp32 units in the last place of the largest
weight after two steps of a tiny model, tests/distributed/test_single_rank_sync.py).

megatron offers no constructor argument for it, so the optimizer's parameter groups are switched
after it is built (``fused`` is one of the per-group options torch reads at every step) and again
after an optimizer state is loaded, since ``load_state_dict`` restores the groups' saved options.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# The devices torch's fused Adam kernel runs on that megarl uses.
_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _inner_torch_adams(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch Adam/AdamW optimizers inside a megatron optimizer (chained or not)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            yield inner


def _fusable(group: dict[str, object]) -> bool:
    params = group["params"]
    assert isinstance(params, list)
    return not group.get("differentiable") and all(
        p.device.type in _FUSED_DEVICES and p.dtype in _FUSED_DTYPES for p in params
    )


def use_fused_adam(optimizer, on: bool = True) -> int:
    """Switch every parameter group of the torch Adam(W) inside ``optimizer`` (a megatron
    optimizer) to torch's fused kernel (``on=False``: back to torch's default, megatron's own
    path); returns the number of groups that run fused. Groups whose parameters the kernel cannot
    take (another device or dtype) keep torch's default, as do Transformer Engine's and apex's
    fused optimizers, which are not torch Adam."""
    fused = 0
    for inner in _inner_torch_adams(optimizer):
        for group in inner.param_groups:
            if on and _fusable(group):
                group["fused"], group["foreach"] = True, False
                fused += 1
            else:
                group["fused"], group["foreach"] = None, None
        inner.defaults["fused"] = all(g.get("fused") for g in inner.param_groups)
    return fused


def uses_fused_adam(optimizer) -> bool:
    """Whether every torch Adam parameter group inside ``optimizer`` runs fused."""
    groups = [g for inner in _inner_torch_adams(optimizer) for g in inner.param_groups]
    return bool(groups) and all(g.get("fused") for g in groups)
