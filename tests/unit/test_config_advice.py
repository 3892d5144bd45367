"""Valid settings that are probably a mistake are said before launch: elastic restarts with
nothing saved to restart from, and multi-turn budgets where the model's turns leave no room for
the environment's messages."""

from __future__ import annotations

import pytest

from megarl.config import load_config
from megarl.config.advice import config_warnings

pytestmark = pytest.mark.unit

BASE = ["model.path=m", "data.train_files=[a.parquet]", "rollout.sampling.max_response_length=72"]
MULTI_TURN = ["rollout.env=envs.py:Relay", "rollout.environment.max_turns=3"]


def _warnings(*overrides: str) -> list[str]:
    return config_warnings(load_config(overrides=[*BASE, *overrides]))


def test_turns_that_fill_the_response_budget_are_warned_of():
    [text] = _warnings(
        *MULTI_TURN, "rollout.environment.max_turn_tokens=24"
    )  # 3 x 24 = 72: no room
    assert text.startswith(
        "rollout.environment.max_turns=3 turns of up to rollout.environment.max_turn_tokens=24 tokens"
    )
    assert "take 72 of rollout.sampling.max_response_length=72" in text
    assert "rollout/budget_cut" in text and "raise rollout.sampling.max_response_length" in text
    assert (
        _warnings(*MULTI_TURN, "rollout.environment.max_turn_tokens=12") == []
    )  # 36 of 72: room left
    assert _warnings(*MULTI_TURN) == []  # no per-turn limit: each turn takes what is left
    assert (
        _warnings("rollout.environment.max_turns=3", "rollout.environment.max_turn_tokens=24") == []
    )  # no env


def test_restarts_without_saves_are_warned_of():
    [text] = _warnings("trainer.elastic.max_restarts=2", "trainer.save_freq=0")
    assert "starts the run again from the beginning; set trainer.save_freq" in text
    assert _warnings("trainer.elastic.max_restarts=2", "trainer.save_freq=5") == []
