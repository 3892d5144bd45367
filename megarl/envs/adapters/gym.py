"""Gymnasium text environments as megarl environments: ``rollout.env=
"megarl.envs.adapters.gym:GymnasiumEnvironment"`` with ``rollout.env_kwargs.env_id`` (a registered
gymnasium id) or ``entry_point`` ("module:Class" / "file.py:Class"), and ``make_kwargs``.

The gymnasium environment's observations are text (``str``; a ``dict`` observation is read at
``observation_key``), its actions the model's turn as text. ``reset`` is called with the
sample's seed (``seed`` is 32-bit in gymnasium) and the dataset row as ``options={"row": row}``;
its observation becomes the user's first message (after ``system_prompt``). Each model turn is
one ``step(action)``: its reward is the turn's reward, ``terminated or truncated`` ends the
trajectory, and otherwise the next observation is the user's next message. Gymnasium rewards
every step, so the run's rule scorer is not used with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megarl.envs.base import EnvError, Environment, Message, Step
from megarl.errors import ConfigError
from megarl.rewards.loading import load_callable


class GymnasiumEnvironment(Environment):
    def __init__(
        self,
        env_id: str | None = None,
        entry_point: str | None = None,
        make_kwargs: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
        observation_key: str | None = None,
    ) -> None:
        import gymnasium

        if (env_id is None) == (entry_point is None):
            raise ConfigError(
                "GymnasiumEnvironment needs exactly one of env_id (a registered gymnasium id) "
                "or entry_point ('module:Class' / 'file.py:Class')"
            )
        kwargs = dict(make_kwargs or {})
        if env_id is not None:
            try:
                self.env = gymnasium.make(env_id, **kwargs)
            except gymnasium.error.Error as e:
                raise ConfigError(f"gymnasium.make({env_id!r}) failed: {e}") from e
        else:
            assert entry_point is not None  # exactly one of the two, checked above
            cls = load_callable(entry_point, what="gymnasium entry_point", name="Class")
            self.env = cls(**kwargs)
        self.system_prompt = system_prompt
        self.observation_key = observation_key

    def _text(self, observation: object, where: str) -> str:
        if isinstance(observation, Mapping) and self.observation_key is not None:
            observation = observation.get(self.observation_key)
        if not isinstance(observation, str):
            raise EnvError(
                f"{where}: the gymnasium environment's observation is "
                f"{type(observation).__name__} {observation!r:.60}, not text; use a text "
                "environment, or set observation_key to the text field of a dict observation"
            )
        return observation

    def reset(self, row: dict[str, object]) -> list[Message]:
        observation, _ = self.env.reset(seed=self.seed % (1 << 32), options={"row": row})
        messages: list[Message] = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": self._text(observation, "reset")})
        return messages

    def step(self, messages: list[Message]) -> Step:
        observation, reward, terminated, truncated, _ = self.env.step(messages[-1]["content"])
        done = bool(terminated or truncated)
        follow = [] if done else [{"role": "user", "content": self._text(observation, "step")}]
        return Step(messages=follow, reward=float(reward), done=done)
