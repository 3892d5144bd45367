"""The gymnasium adapter: a text gymnasium environment (defined here) played through megarl's
environment API, seeded per sample, with its rewards and termination."""

from __future__ import annotations

import string

import gymnasium
import pytest

from megarl.envs import EnvContext, EnvError
from megarl.envs.adapters.gym import GymnasiumEnvironment
from megarl.envs.base import bind_context, check_reset, check_step
from megarl.envs.loading import check_environment
from megarl.errors import ConfigError

pytestmark = pytest.mark.unit


class GuessNumber(gymnasium.Env):
    """Guess a number in 1..9: "higher"/"lower" until found (reward 1) or 3 guesses (truncated)."""

    observation_space = gymnasium.spaces.Text(64, charset=string.printable)
    action_space = gymnasium.spaces.Text(64, charset=string.printable)

    def __init__(self, limit: int = 3):
        self.limit = limit

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.secret, self.guesses = int(self.np_random.integers(1, 10)), 0
        topic = (options or {}).get("row", {}).get("prompt", "")
        return f"{topic} Guess my number (1-9).", {}

    def step(self, action):
        self.guesses += 1
        digits = [int(c) for c in action if c.isdigit()]
        guess = digits[-1] if digits else 0
        if guess == self.secret:
            return "right", 1.0, True, False, {}
        hint = "higher" if guess < self.secret else "lower"
        return hint, 0.0, False, self.guesses >= self.limit, {}


class NotText(GuessNumber):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed, options=options)
        return 7, {}


def _env(**kwargs) -> GymnasiumEnvironment:
    env = GymnasiumEnvironment(entry_point=f"{__file__}:GuessNumber", **kwargs)
    bind_context(env, EnvContext(seed=12345))
    return env


def _play(env, guesses):
    messages = check_reset(env, env.reset({"prompt": "Game:"}))
    steps = []
    for g in guesses:
        messages.append({"role": "assistant", "content": f"I guess {g}"})
        step = check_step(env, env.step(messages))
        steps.append(step)
        messages += step.messages
        if step.done:
            break
    return messages, steps


def test_a_gymnasium_game_through_the_environment_api():
    env = _env(system_prompt="Play.")
    messages, steps = _play(env, range(1, 10))
    assert messages[0] == {"role": "system", "content": "Play."}
    assert messages[1]["content"] == "Game: Guess my number (1-9)."
    secret = env.env.unwrapped.secret
    if secret <= 3:  # found within the 3 guesses
        assert steps[-1].done and steps[-1].reward == 1.0 and len(steps) == secret
    else:  # truncated after 3 wrong guesses, each answered "higher"
        assert len(steps) == 3 and steps[-1].done and steps[-1].reward == 0.0
        assert [m["content"] for m in messages if m["role"] == "user"][1:] == ["higher", "higher"]
    # the same seed, the same secret; another seed, another game (over several seeds)
    secrets = set()
    for seed in range(20):
        e = GymnasiumEnvironment(entry_point=f"{__file__}:GuessNumber")
        bind_context(e, EnvContext(seed=seed))
        e.reset({})
        secrets.add(e.env.unwrapped.secret)
        again = GymnasiumEnvironment(entry_point=f"{__file__}:GuessNumber")
        bind_context(again, EnvContext(seed=seed))
        again.reset({})
        assert again.env.unwrapped.secret == e.env.unwrapped.secret
    assert len(secrets) > 3


def test_registered_ids_and_errors():
    gymnasium.register(id="MegarlTest/Guess-v0", entry_point=GuessNumber)
    env = GymnasiumEnvironment(env_id="MegarlTest/Guess-v0", make_kwargs={"limit": 1})
    bind_context(env, EnvContext(seed=1))
    _, steps = _play(env, [0])
    assert steps[0].done  # one guess allowed
    assert check_environment("megarl.envs.adapters.gym:GymnasiumEnvironment", {"env_id": "x"})
    with pytest.raises(ConfigError, match="exactly one of env_id"):
        GymnasiumEnvironment()
    with pytest.raises(ConfigError, match=r"gymnasium\.make"):
        GymnasiumEnvironment(env_id="NoSuchEnv-v9")
    bad = GymnasiumEnvironment(entry_point=f"{__file__}:NotText")
    bind_context(bad, EnvContext(seed=1))
    with pytest.raises(EnvError, match="not text"):
        bad.reset({})
