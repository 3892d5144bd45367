"""Loading a user's scorer (or environment class) from a spec string: "package.module:function" or
"path/to/file.py:function".

Specs (not function objects) are what crosses into scorer worker processes, so a scorer defined
in a user's file works in a process pool without being importable as a package.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from megarl.errors import ConfigError
from megarl.import_paths import load_object


def load_callable(spec: str, what: str = "scorer", name: str = "function") -> Callable[..., Any]:
    """The function (or class) a spec names; a ConfigError says what is wrong with the spec.
    ``what`` and ``name`` word the messages ("scorer" and "function", "rollout.env" and "Class")."""
    fn = load_object(spec, f"{what} {spec!r}")
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r}: '{spec.rpartition(':')[2]}' is not callable.")
    return fn


def spec_of(fn: Callable[..., object]) -> str | None:
    """A spec that re-imports `fn` in another process, or None when there is none (lambdas, closures)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qualname or module == "__main__":
        return None
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None)
    if module.startswith("megarl_user_scorer_") and file:
        return f"{file}:{qualname}"
    try:
        return f"{module}:{qualname}" if load_callable(f"{module}:{qualname}") is fn else None
    except ConfigError:
        return None
