"""``rollout.env``: the environment class a run uses, found and checked before any model is built."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from megarl.envs.base import Environment
from megarl.errors import ConfigError
from megarl.rewards.loading import load_callable


def load_environment(spec: str) -> type[Environment]:
    """The :class:`Environment` subclass ``spec`` ("module:Class" or "path/to/file.py:Class")
    names; a ConfigError says what is wrong."""
    cls = load_callable(spec, what="rollout.env", name="Class")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(
            f"rollout.env={spec!r} names {cls!r:.80}, which is not a subclass of "
            "megarl.envs.Environment; define `class MyEnv(Environment)` with reset(row) and "
            "step(messages)"
        )
    missing = [m for m in ("reset", "step") if getattr(cls, m) is getattr(Environment, m)]
    if missing:
        raise ConfigError(f"rollout.env={spec!r}: {cls.__qualname__} does not implement {missing}")
    return cls


def check_environment(spec: str, kwargs: Mapping[str, object]) -> type[Environment]:
    """The class, with ``rollout.env_kwargs`` checked against its ``__init__`` and its own
    :meth:`Environment.check_settings` (no instance made)."""
    cls = load_environment(spec)
    try:
        inspect.signature(cls).bind(**dict(kwargs))
    except TypeError as e:
        params = [
            p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")
        ]
        raise ConfigError(
            f"rollout.env_kwargs {sorted(kwargs)} do not fit {cls.__qualname__}.__init__ ({e}); "
            f"it takes {params}"
        ) from None
    cls.check_settings(kwargs)
    return cls


def make_environment(cls: type[Environment], kwargs: Mapping[str, object]) -> Environment:
    return cls(**dict(kwargs))
