"""The environment API of multi-turn rollouts: :class:`Environment` and the :class:`Step` it returns.

An environment plays the other side of a conversation with the policy. It starts one trajectory
from a dataset row (:meth:`Environment.reset` returns the chat messages the model answers first)
and answers each model turn (:meth:`Environment.step`, given the conversation so far, whose last
message is the model's) with the messages to append, a reward and whether the trajectory ends.
One instance serves one sample. ``step`` may be ``async def`` so that I/O-bound environments do
not block each other.

The rollout binds a context to each instance before ``reset`` (:attr:`Environment.context`): its
seed (from the run's seed and the sample's global index, so a trajectory does not depend on the
parallel layout), a ``random.Random`` seeded with it, the pool tool calls run in, and whether the
chat template renders tool schemas itself.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megarl.errors import MegarlError

if TYPE_CHECKING:
    from megarl.envs.pool import ToolPool

Message = dict[str, Any]
# What an environment may append: the user's next message or tool results.
STEP_ROLES = ("user", "tool")


class EnvError(MegarlError):
    """An environment broke the API (a bad ``reset``/``step`` result), or too many samples of a
    step failed."""


@dataclass(frozen=True)
class Step:
    """An environment's answer to one model turn.

    ``messages``: appended to the conversation (role ``user`` or ``tool``); ``reward``: this
    turn's reward (None counts as 0; a trajectory whose turns all give None is scored by the
    run's reward instead); ``done``: the trajectory ends (the messages given with it are kept in
    the conversation but not tokenised: no model turn follows them). ``metrics``: counters of
    this turn (e.g. ``tool_calls``), summed over the trajectory and logged per trajectory.
    """

    messages: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EnvContext:
    """What the rollout tells an environment instance before its ``reset``."""

    seed: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    pool: ToolPool | None = None
    # The chat template renders the ``tools`` schemas (Qwen2.5 does, SmolLM2 does not: an
    # environment with tools then describes them in its own system message).
    template_renders_tools: bool = True
    sample_index: int = 0  # the sample's index in the whole step (all ranks)


class Environment:
    """Subclass it: ``__init__(**kwargs)`` gets ``rollout.env_kwargs``; implement ``reset`` and
    ``step``. ``tool_schemas`` (optional) lists JSON schemas handed to the chat template."""

    context: EnvContext

    def __init__(self, **kwargs: object) -> None:
        if kwargs:
            raise TypeError(
                f"{type(self).__name__} takes no keyword arguments, got {sorted(kwargs)}; define "
                "__init__(self, **kwargs) to accept rollout.env_kwargs"
            )

    def reset(self, row: dict[str, object]) -> list[Message]:
        """The conversation the model answers first, from a dataset row (its columns)."""
        raise NotImplementedError(f"{type(self).__name__} must implement reset(row)")

    def step(self, messages: list[Message]) -> Step:
        """The answer to the model's turn (``messages[-1]``, role ``assistant``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement step(messages)")

    def tool_schemas(self) -> list[dict[str, object]] | None:
        """JSON schemas of the tools the model may call (the chat template's ``tools``)."""
        return None

    @classmethod
    def check_settings(cls, kwargs: Mapping[str, object]) -> None:
        """Refuse ``rollout.env_kwargs`` that cannot work here (a ConfigError naming the fix);
        called before any model is built, on the launching process and on every rank."""

    @property
    def rng(self) -> random.Random:
        """This sample's random generator (seeded from the run's seed and the sample index)."""
        return self.context.rng

    @property
    def seed(self) -> int:
        return self.context.seed


def bind_context(env: Environment, context: EnvContext) -> None:
    """Set ``env.context`` (a subclass's ``__init__`` need not call ``super().__init__``)."""
    env.context = context


def _where(env: Environment, method: str) -> str:
    return f"{type(env).__module__}.{type(env).__qualname__}.{method}"


def check_messages(
    value: object, *, where: str, roles: Sequence[str] | None = None
) -> list[Message]:
    """``value`` as a list of chat messages (string role and content), else an EnvError."""
    if not isinstance(value, list):
        raise EnvError(
            f"{where} returned {type(value).__name__} {value!r:.80}; it must return a list of "
            "chat messages like [{'role': 'user', 'content': '...'}]"
        )
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise EnvError(
                f"{where}: message {i} is {type(m).__name__} {m!r:.80}, not a dict with "
                "'role' and 'content'"
            )
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise EnvError(
                f"{where}: message {i} needs a string 'role' and a string 'content', got "
                f"{dict(m)!r:.120}"
            )
        if roles is not None and role not in roles:
            raise EnvError(
                f"{where}: message {i} has role {role!r}; an environment appends messages of "
                f"role {' or '.join(repr(r) for r in roles)} (the model writes the assistant's)"
            )
        out.append(dict(m))
    return out


def check_reset(env: Environment, value: object) -> list[Message]:
    messages = check_messages(value, where=_where(env, "reset"))
    if not messages:
        raise EnvError(f"{_where(env, 'reset')} returned no messages; the model needs a prompt")
    if messages[-1]["role"] == "assistant":
        raise EnvError(
            f"{_where(env, 'reset')}: the conversation ends with an assistant message; the "
            "model's turn comes next, so end it with the user's (or a tool's) message"
        )
    return messages


def check_step(env: Environment, value: object) -> Step:
    """A well-formed :class:`Step` (messages checked), else an EnvError naming the problem."""
    where = _where(env, "step")
    if not isinstance(value, Step):
        raise EnvError(
            f"{where} returned {type(value).__name__} {value!r:.80}; it must return "
            "megarl.envs.Step(messages=[...], reward=None, done=False)"
        )
    messages = check_messages(value.messages, where=where, roles=STEP_ROLES)
    reward = value.reward
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise EnvError(f"{where}: Step.reward must be a number or None, got {reward!r:.80}")
        if not math.isfinite(float(reward)):
            raise EnvError(f"{where}: Step.reward is {reward}; it must be finite")
        reward = float(reward)
    if not isinstance(value.done, bool):
        raise EnvError(f"{where}: Step.done must be True or False, got {value.done!r:.80}")
    if not value.done and not messages:
        raise EnvError(
            f"{where}: a Step that does not end the trajectory must give the messages the model "
            "answers next (or set done=True)"
        )
    metrics = value.metrics
    if not isinstance(metrics, Mapping) or not all(
        isinstance(k, str) and isinstance(v, int | float) and math.isfinite(float(v))
        for k, v in metrics.items()
    ):
        raise EnvError(
            f"{where}: Step.metrics must map names to finite numbers, got {metrics!r:.80}"
        )
    return Step(
        messages=messages,
        reward=reward,
        done=value.done,
        metrics={k: float(v) for k, v in metrics.items()},
    )
