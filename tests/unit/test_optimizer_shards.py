"""The flat-range decomposition behind gather-free optimizer checkpoints: a distributed-optimizer
shard (a flat range of a parameter's local tensor) as rectangular blocks of that tensor."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megarl.run.optimizer_shards import flat_range_blocks

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (1, 5), (4, 1, 3)])
def test_blocks_cover_exactly_the_range_in_flat_order(shape):
    index = torch.arange(math.prod(shape)).view(shape)
    for lo, hi in itertools.combinations(range(math.prod(shape) + 1), 2):
        blocks = flat_range_blocks(shape, lo, hi)
        covered = []
        for offset, block, start in blocks:
            part = index[tuple(slice(o, o + s) for o, s in zip(offset, block, strict=True))]
            flat = part.reshape(-1).tolist()
            assert flat == list(range(start, start + len(flat))), (shape, lo, hi, blocks)
            covered += flat
        assert covered == list(range(lo, hi)), (shape, lo, hi, blocks)
        assert len(blocks) <= 2 * len(shape) - 1  # a few blocks, whatever the range


def test_an_empty_range_has_no_blocks():
    assert flat_range_blocks((3, 4), 5, 5) == []
