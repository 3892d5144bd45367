"""The GPU check's section choice (``--sections``), on the CPU: a short GPU lease reruns only what
failed, so a wrong number must be refused before any section runs."""

from __future__ import annotations

import pytest

from megarl.tools.gpu_check import SECTIONS, _chosen_sections


def test_no_choice_runs_every_section():
    assert _chosen_sections(None) == SECTIONS


def test_chosen_sections_keep_their_order():
    names = [name for name, _ in _chosen_sections("4, 1")]
    assert names == ["1 logits", "4 GRPO"]


@pytest.mark.parametrize("bad", ["9", "1,x", "", ","])
def test_unknown_sections_are_refused_with_the_known_ones(bad):
    with pytest.raises(SystemExit, match=r"--sections takes numbers among 1, 2, 3, 4, 5"):
        _chosen_sections(bad)
