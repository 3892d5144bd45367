"""trainer.profile_steps: 1-based steps, a Chrome trace for each listed step, nothing otherwise."""

from __future__ import annotations

import json

import pytest
import torch

from megarl.errors import ConfigError
from megarl.trainer.profiling import StepProfiler


def test_only_listed_steps_are_traced(tmp_path):
    profiler = StepProfiler([2], tmp_path)
    seen = []
    for index in profiler.iterate(range(3)):  # loop indices 0, 1, 2 are steps 1, 2, 3
        torch.ones(8, 8) @ torch.ones(8, 8)
        seen.append(index)
    assert seen == [0, 1, 2]
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["step_2_rank0.json"]
    events = json.loads((tmp_path / "profile" / "step_2_rank0.json").read_text())["traceEvents"]
    assert any("mm" in e.get("name", "") for e in events)


def test_a_resumed_loop_keeps_step_numbers(tmp_path):
    profiler = StepProfiler([1, 4], tmp_path)
    assert list(profiler.iterate(range(3, 4))) == [3]  # resumed at step 4: index 3
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["step_4_rank0.json"]


def test_no_steps_no_profiler_no_folder(tmp_path):
    assert list(StepProfiler([], tmp_path).iterate(range(2))) == [0, 1]
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("steps", [[0], [3, -1]])
def test_steps_are_one_based(tmp_path, steps):
    with pytest.raises(ConfigError, match="1-based"):
        StepProfiler(steps, tmp_path)
