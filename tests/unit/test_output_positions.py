"""The output layer's position selection is scoped to a ``with`` block: no attribute on the layer,
nothing left behind after the block (exception or not), no effect on another model's layer."""

from __future__ import annotations

import pytest
import torch

from megarl.models.forward import output_positions, use_batch_major_output

pytestmark = pytest.mark.unit


class _Head(torch.nn.Module):
    """An output layer as megatron's is called: ``[s, b, h]`` in, ``(out, bias)`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 4, bias=False)

    def forward(self, hidden: torch.Tensor):
        return self.proj(hidden), None


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.output_layer = _Head()


def _hidden() -> torch.Tensor:
    return torch.arange(5 * 2 * 3, dtype=torch.float32).reshape(5, 2, 3)  # [s, b, h]


def test_positions_hold_inside_the_block_only_and_set_no_attribute():
    torch.manual_seed(0)
    model, other = _Model(), _Model()
    layer = model.output_layer
    attributes = set(vars(layer))
    hidden = _hidden()
    full = layer.proj(hidden)  # [s, b, v]
    positions = torch.tensor([[1, 4], [0, 2]])  # [b, P]
    with output_positions(model, positions):
        out, _ = layer(hidden)  # [P, b, v]: the view GPTModel transposes back to [b, P, v]
        untouched, _ = other.output_layer(hidden)  # another model's layer: every position
    expected = torch.stack([full[positions[i], i] for i in range(2)])  # [b, P, v]
    torch.testing.assert_close(out.transpose(0, 1), expected, rtol=0, atol=0)
    assert untouched.shape == (5, 2, 4)
    after, _ = layer(hidden)
    torch.testing.assert_close(after, full, rtol=0, atol=0)  # the block's positions are gone
    assert set(vars(layer)) == attributes  # hooks registered, no attribute of megarl's own


def test_an_exception_in_the_block_ends_the_scope():
    model = _Model()
    hidden = _hidden()
    with (
        pytest.raises(RuntimeError, match="boom"),
        output_positions(model, torch.tensor([[0], [1]])),
    ):
        raise RuntimeError("boom")
    out, _ = model.output_layer(hidden)
    assert out.shape == (5, 2, 4)


def test_sequence_major_output_is_megatrons_layout():
    model = _Model()
    hidden = _hidden()
    use_batch_major_output(model, False)
    with output_positions(model, torch.tensor([[3, 4], [1, 2]])):
        out, _ = model.output_layer(hidden)
    assert out.is_contiguous() and out.shape == (2, 2, 4)  # [P, b, v] as projected, no view
    use_batch_major_output(model, True)
    with output_positions(model, torch.tensor([[3, 4], [1, 2]])):
        out, _ = model.output_layer(hidden)
    assert not out.is_contiguous() and out.shape == (2, 2, 4)  # the [b, P, v] projection's view
