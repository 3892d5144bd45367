"""megarl.models.fused_adam: which optimizer groups it switches to torch's fused AdamW kernel, and
that a switched group steps as torch's own ``AdamW(fused=True)`` does (bitwise, same kernel).
With real megatron optimizers it is checked in tests/distributed/test_single_rank_sync.py."""

from __future__ import annotations

import types

import pytest
import torch

from megarl.models.fused_adam import use_fused_adam, uses_fused_adam

pytestmark = pytest.mark.unit


def _megatron_like(*inner: torch.optim.Optimizer) -> types.SimpleNamespace:
    """The shape of megatron's ChainedOptimizer: parts, each holding a torch optimizer."""
    return types.SimpleNamespace(
        chained_optimizers=[types.SimpleNamespace(optimizer=o) for o in inner]
    )


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=gen).to(dtype)) for _ in range(2)]


def test_switches_torch_adam_groups_and_steps_as_torch_fused():
    params, twins = _params(0), _params(0)
    adam = torch.optim.AdamW(
        [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2
    )
    wrapped = _megatron_like(adam)
    assert not uses_fused_adam(wrapped)
    assert use_fused_adam(wrapped) == 2 and uses_fused_adam(wrapped)
    reference = torch.optim.AdamW(
        [{"params": twins[:1]}, {"params": twins[1:], "weight_decay": 0.0}], lr=1e-2, fused=True
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(5, 3, generator=gen) for _ in params]
        for p, t, g in zip(params, twins, grads, strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        adam.step()
        reference.step()
    assert all(torch.equal(p, t) for p, t in zip(params, twins, strict=True))
    assert any(not torch.equal(p, q) for p, q in zip(params, _params(0), strict=True))

    # Back to torch's default (megatron's own path) on request.
    assert use_fused_adam(wrapped, on=False) == 0 and not uses_fused_adam(wrapped)
    assert all(g["fused"] is None and g["foreach"] is None for g in adam.param_groups)


def test_leaves_what_the_kernel_cannot_take_and_other_optimizers():
    ints = [torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)]
    adam = torch.optim.Adam([{"params": _params(2)}, {"params": ints}], lr=1e-3)
    sgd = torch.optim.SGD(_params(3), lr=1e-3)  # not Adam: e.g. apex's / TE's own fused Adam
    wrapped = _megatron_like(adam, sgd)
    assert use_fused_adam(wrapped) == 1
    assert [g["fused"] for g in adam.param_groups] == [True, None]
    assert "fused" not in sgd.param_groups[0] or not sgd.param_groups[0]["fused"]
    assert not uses_fused_adam(wrapped)  # one group could not switch
    # A megatron optimizer that is not chained holds its torch optimizer directly.
    single = types.SimpleNamespace(optimizer=torch.optim.AdamW(_params(4), lr=1e-3))
    assert use_fused_adam(single) == 1 and uses_fused_adam(single)
