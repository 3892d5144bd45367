"""Loading a user's scorer (or environment class) from a spec string: "package.module:function" or
"path/to/file.py:function".

Specs (not function objects) are what crosses into scorer worker processes, so a scorer defined
in a user's file works in a process pool without being importable as a package.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from megarl.errors import ConfigError

_FORM = "give 'package.module:{name}' or 'path/to/file.py:{name}'"


def _module_from_file(path: str, what: str = "scorer", name: str = "function") -> Any:
    form = _FORM.format(name=name)
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ConfigError(f"{what} file '{path}' does not exist; {form}.")
    # One module per file path, registered so pickling and dataclasses inside it work.
    name = "megarl_user_scorer_" + hashlib.sha256(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what} file '{path}' cannot be loaded as Python; {form}.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"{what} file '{path}' failed to import: {type(e).__name__}: {e}") from e
    return module


def load_callable(spec: str, what: str = "scorer", name: str = "function") -> Callable[..., Any]:
    """The function (or class) a spec names; a ConfigError says what is wrong with the spec.
    ``what`` and ``name`` word the messages ("scorer" and "function", "rollout.env" and "Class")."""
    form = _FORM.format(name=name)
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{what} {spec!r} is not a {name} spec; {form}.")
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise ConfigError(f"{what} {spec!r} is not a {name} spec; {form}.")
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _module_from_file(where, what, name)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(
                f"{what} {spec!r}: cannot import module '{where}' ({e}); {form}."
            ) from e
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"{what} {spec!r}: '{where}' has no attribute '{attr}'.")
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r}: '{attr}' is not callable.")
    return fn


def spec_of(fn: Callable[..., Any]) -> str | None:
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
