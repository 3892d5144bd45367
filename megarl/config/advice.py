"""Settings that are valid but probably not what the user meant, said before launch as
``megarl: warning:`` lines (the run still starts: a warning never stops it)."""

from __future__ import annotations

from megarl.config.schema import RolloutConfig, RunConfig, TrainerConfig


def _restarts_without_saves(t: TrainerConfig) -> str | None:
    if t.elastic.max_restarts and not t.save_freq:
        return (
            "trainer.elastic.max_restarts is set but trainer.save_freq=0 saves only at the end, "
            "so a restart starts the run again from the beginning; set trainer.save_freq"
        )
    return None


def _turns_without_room(r: RolloutConfig) -> str | None:
    """Multi-turn: the model's own turns at their longest fill the response budget, so every
    environment message between them takes room from the last turns."""
    if r.env is None or r.environment.max_turns < 2 or r.environment.max_turn_tokens is None:
        return None
    model_tokens = r.environment.max_turns * r.environment.max_turn_tokens
    if model_tokens < r.sampling.max_response_length:
        return None
    return (
        f"rollout.environment.max_turns={r.environment.max_turns} turns of up to rollout.environment.max_turn_tokens="
        f"{r.environment.max_turn_tokens} tokens take {model_tokens} of rollout.sampling.max_response_length="
        f"{r.sampling.max_response_length}, leaving no room for the environment's messages between "
        "them: trajectories whose turns run long end at the budget before their last turn "
        "(counted by rollout/budget_cut); raise rollout.sampling.max_response_length or lower "
        "rollout.environment.max_turn_tokens"
    )


def config_warnings(cfg: RunConfig) -> list[str]:
    """Every warning that applies to ``cfg``, in a fixed order (each advice reads its sections)."""
    advice = (_restarts_without_saves(cfg.trainer), _turns_without_room(cfg.rollout))
    return [text for text in advice if text is not None]
