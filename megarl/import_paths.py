"""Settings that name Python code (``reward.custom_fn``, and any other listed in
``megarl.run.checks.IMPORT_SETTINGS``): imported and checked before any model is built, so a typo
costs seconds, not the minutes a large model takes to load.

A path is ``package.module:name`` or ``path/to/file.py:name`` (a file is imported as a module of
its own, registered so that pickling what it defines works in worker processes).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from megarl.errors import ConfigError

FORM = "give 'package.module:name' or 'path/to/file.py:name'"


def _module_from_file(path: str, what: str) -> ModuleType:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ConfigError(f"{what}: file '{path}' does not exist; {FORM}.")
    # One module per file path, registered so pickling and dataclasses inside it work.
    name = "megarl_user_scorer_" + hashlib.sha256(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what}: file '{path}' cannot be loaded as Python; {FORM}.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"{what}: file '{path}' failed to import: {type(e).__name__}: {e}") from e
    return module


def is_file_path(where: str) -> bool:
    return where.endswith(".py") or os.sep in where or "/" in where


def load_object(spec: str, what: str) -> Any:
    """The object an import path names; ``what`` (e.g. ``reward.custom_fn='x:y'``) starts every
    error message."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{what} is not an import path; {FORM}.")
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise ConfigError(f"{what} is not an import path; {FORM}.")
    if is_file_path(where):
        module: ModuleType = _module_from_file(where, what)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(f"{what}: cannot import module '{where}' ({e}); {FORM}.") from e
        except Exception as e:  # the module itself fails while importing
            raise ConfigError(
                f"{what}: module '{where}' failed to import: {type(e).__name__}: {e}"
            ) from e
    obj: object = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"{what}: '{where}' has no attribute '{attr}'.")
    return obj


def check_import_path(
    setting: str, spec: str, keywords: Sequence[str] = ()
) -> Callable[..., object]:
    """Import the callable ``spec`` of the config key ``setting`` and check that it can be called
    with the keyword arguments ``keywords``; a ConfigError naming the setting and the fix."""
    what = f"{setting}={spec!r}"
    fn = load_object(spec, what)
    if not callable(fn):
        raise ConfigError(f"{what}: '{spec.rpartition(':')[2]}' is not callable.")
    if keywords:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins without a signature: nothing to check
            return fn
        try:
            signature.bind(**dict.fromkeys(keywords))
        except TypeError as e:
            raise ConfigError(
                f"{what}: it cannot be called as {spec.rpartition(':')[2]}"
                f"({', '.join(f'{k}=...' for k in keywords)}) ({e}); give it those parameters "
                "(or **kwargs)."
            ) from None
    return fn
