"""Name -> function tables for the config words of the algorithms.

A registry is how a config word ("ppo_clip", "grpo", "k3" ...) becomes a function. Calls go through
:meth:`Registry.call`, which checks the keyword arguments against the function's signature first,
so a misspelt hyperparameter in a config fails loudly instead of being swallowed by ``**kwargs``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class UnknownNameError(ValueError):
    """A config word that no function was registered under."""


class DuplicateNameError(ValueError):
    """A second function registered under a name that is taken."""


class Registry(Generic[F]):
    """Functions of one kind (e.g. "policy loss"), registered by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._table: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: ``@POLICY_LOSSES.register("ppo_clip")``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorate(fn: F) -> F:
            if name in self._table:
                raise DuplicateNameError(
                    f"{self.kind} {name!r} is already registered (by {self._table[name].__module__}."
                    f"{self._table[name].__qualname__})"
                )
            self._table[name] = fn
            return fn

        return decorate

    def get(self, name: str) -> F:
        try:
            return self._table[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._table))

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def call(self, name: str, /, *args: object, **kwargs: object) -> Any:
        """Look ``name`` up and call it, naming every unknown or missing keyword in one TypeError."""
        fn = self.get(name)
        check_kwargs(fn, f"{self.kind} {name!r}", len(args), kwargs)
        return fn(*args, **kwargs)


def check_kwargs(fn: Callable[..., object], what: str, n_positional: int, kwargs: dict) -> None:
    """Raise TypeError listing all unknown and all missing keyword arguments of a call to ``fn``.

    Python's own error names only the first bad argument; a config usually has several.
    """
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    named = [
        p
        for p in params[n_positional:]
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    accepted = {p.name for p in named}
    unknown = sorted(set(kwargs) - accepted)
    missing = sorted(
        p.name for p in named if p.default is inspect.Parameter.empty and p.name not in kwargs
    )
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"unknown hyperparameter(s) {unknown}")
        if missing:
            parts.append(f"missing required argument(s) {missing}")
        raise TypeError(f"{what}: {'; '.join(parts)}; it accepts {sorted(accepted)}")
