"""Which optimizer tensors leave the device around the rollout, decided on built optimizers.

megatron's hybrid CPU/GPU optimizer (``actor.optimizer_offload``) runs torch's Adam on the host
for part of the parameters and owns those host tensors (parameter copies, moments, master
weights); only its GPU side's moments may move. Without CUDA the hybrid optimizer is built here
with its CUDA streams mocked and "GPU" parameters that report ``is_cuda`` (it splits parameters
by that flag), so both of its sides exist; everything really lives on the CPU, which is what the
decision must not depend on.
"""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch

from megarl.models.offload import model_tensors, optimizer_moments
from megarl.trainer.rollout_offload import ActorMemory

pytestmark = pytest.mark.unit


class _OnGPU(torch.nn.Parameter):
    """A parameter the hybrid optimizer takes for a GPU one."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _no_cuda():
    """What the hybrid optimizer's construction and step need of CUDA, as no-ops."""
    return (
        mock.patch("torch.cuda.current_stream"),
        mock.patch("torch.cuda.stream"),
        mock.patch.object(torch.Tensor, "pin_memory", lambda self: self),
    )


def _hybrid(seed: int = 0, steps: int = 2):
    """A hybrid optimizer over four 4x4 "GPU" parameters, half of them offloaded (its CPU Adam),
    after ``steps`` steps of fixed gradients; the parameters and the optimizer."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    gen = torch.Generator().manual_seed(seed)
    params = [_OnGPU(torch.randn(4, 4, generator=gen)) for _ in range(4)]
    a, b, c = _no_cuda()
    with a, b, c:
        opt = HybridDeviceOptimizer(
            params,
            offload_fraction=0.5,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.Adam,
            param_update_in_fp32=True,
            overlap_cpu_optimizer_d2h_h2d=False,
            pin_cpu_grads=False,
            lr=1e-2,
        )
        for step in range(steps):
            for i, p in enumerate(params):
                p.grad = torch.full((4, 4), 0.1 * (i + 1 + step))
            opt.step()
    return params, opt


def _ids(tensors) -> set[int]:
    return {id(t) for t in tensors}


def _state_tensors(optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def test_only_the_gpu_side_moments_of_the_hybrid_optimizer_move():
    _, opt = _hybrid()
    # both sides exist: two parameters stepped by the host Adam, two by the "GPU" one
    host_params = [p for cpu in opt.cpu_optimizers for g in cpu.param_groups for p in g["params"]]
    assert len(host_params) == 2 and opt.gpu_optimizer is not None
    gpu_states = list(opt.gpu_optimizer.state.values())
    moments = [s[k] for s in gpu_states for k in ("exp_avg", "exp_avg_sq")]
    moving = optimizer_moments(opt)
    assert _ids(moving) == _ids(moments) and len(moving) == 4
    host_side = [t for cpu in opt.cpu_optimizers for t in _state_tensors(cpu)]
    assert len(host_side) == 8  # step, exp_avg, exp_avg_sq, master_param of 2 parameters
    assert not _ids(moving) & _ids(host_side)
    # master weights and step counts never move: they are parameters / host scalars
    assert not _ids(moving) & _ids(s["master_param"] for s in gpu_states)
    assert not _ids(moving) & _ids(s["step"] for s in gpu_states)
    # the model's own tensors under param_offload: the hybrid optimizer's host side stays out
    assert not _ids(model_tensors(torch.nn.Module(), opt)) & _ids(host_side)
    assert _ids(moments) <= _ids(model_tensors(torch.nn.Module(), opt))


def test_all_moments_of_a_plain_optimizer_move():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    states = list(opt.state.values())
    assert _ids(optimizer_moments(opt)) == _ids(
        s[k] for s in states for k in ("exp_avg", "exp_avg_sq")
    )


def test_the_hybrid_optimizer_steps_on_exactly_after_its_moments_went_to_the_host_and_back():
    """The rollout's release and restore (``ActorMemory``) around a hybrid optimizer: the GPU
    side's moments really leave their storage and come back bit for bit; the host side is
    untouched throughout; the next step equals an undisturbed twin's."""
    params, opt = _hybrid()
    twin_params, twin = _hybrid()
    host_side = [t for cpu in opt.cpu_optimizers for t in _state_tensors(cpu)]
    host_before = [t.clone() for t in host_side]
    memory = ActorMemory(
        types.SimpleNamespace(buffers=[], expert_parallel_buffers=[]), opt, move_optimizer=True
    )
    metrics = memory.release()
    moved = optimizer_moments(opt)
    assert metrics["offload/actor_optimizer_bytes"] == sum(t.numel() * 4 for t in moved) > 0
    assert all(t.untyped_storage().nbytes() == 0 for t in moved)
    assert all(t.untyped_storage().nbytes() > 0 for t in host_side)
    memory.restore()
    assert all(torch.equal(a, b) for a, b in zip(host_side, host_before, strict=True))
    a, b, c = _no_cuda()
    with a, b, c:
        for group, optimizer in ((params, opt), (twin_params, twin)):
            for i, p in enumerate(group):
                p.grad = torch.full((4, 4), -0.3 * (i + 1))
            optimizer.step()
    for p, q in zip(params, twin_params, strict=True):
        assert torch.equal(p, q)
