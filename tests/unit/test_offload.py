"""Offload/onload of model, grad and optimizer storage: the round trip is bit-exact, storage is
really released in between, and views (megatron's params inside a flat buffer) survive."""

from __future__ import annotations

import pytest
import torch

from megarl.models.offload import model_tensors, offload, onload

pytestmark = pytest.mark.unit


def _trained_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32, device="cpu"),
        torch.nn.RMSNorm(32),
        torch.nn.Linear(32, 4, device="cpu"),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 16, device="cpu")).square().mean().backward()
        opt.step()
    return model, opt


def test_round_trip_is_exact_and_releases_storage():
    model, opt = _trained_model()
    tensors = model_tensors(model, opt)
    before = [t.detach().clone() for t in tensors]
    distinct = {t.untyped_storage().data_ptr(): t for t in tensors}.values()
    nbytes = sum(t.numel() * t.element_size() for t in distinct)
    moved = offload(tensors)
    # distinct storages: 5 params + their grads, AdamW's exp_avg, exp_avg_sq and step per param
    assert len(moved.host) == 25
    assert moved.bytes_moved == nbytes
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    onload(moved)
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t, b)
    # Training continues from the restored state exactly as from an untouched copy.
    twin, twin_opt = _trained_model()
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m(torch.ones(2, 16, device="cpu")).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_views_into_one_flat_buffer_move_once_and_stay_views():
    flat = torch.arange(12, dtype=torch.float32, device="cpu")
    a, b = flat[:4].view(2, 2), flat[4:]
    moved = offload([a, b, flat])
    assert moved.bytes_moved == 12 * 4 and len(moved.host) == 1
    assert flat.untyped_storage().nbytes() == 0
    onload(moved)
    flat[0] = 100.0  # still one storage: writes show through the views
    assert a[0, 0].item() == 100.0 and b.tolist() == list(map(float, range(4, 12)))
