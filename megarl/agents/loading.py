"""``rollout.agent``: the agent function a run uses, found and checked before any model is built.

The interface (issue 47): ``NAME(row: dict, base_url: str, model: str) -> float | None``, a plain
function or an ``async def``, named as ``"path/to/file.py:NAME"`` (``"package.module:NAME"`` works
too). It is called once per sample with the sample's dataset row, the base URL of its own session
of the OpenAI-compatible endpoint and the model name to send; it returns the sample's reward, or
None to have the row's scorer score the final reply.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from megarl.errors import ConfigError
from megarl.import_paths import FORM, load_object

AgentResult = float | int | None
AgentFn = Callable[[dict[str, object], str, str], AgentResult | Awaitable[AgentResult]]
PARAMETERS = ("row", "base_url", "model")
SIGNATURE = "NAME(row: dict, base_url: str, model: str) -> float | None"


@dataclass(frozen=True)
class Agent:
    """A loaded agent: the function, the spec it came from, and whether calling it gives a
    coroutine (``async def``, or an object whose ``__call__`` is one)."""

    fn: AgentFn
    spec: str
    is_async: bool


def _is_async(fn: object) -> bool:
    call = getattr(fn, "__call__", None)  # noqa: B004 - an instance's async __call__ counts
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def load_agent(spec: str) -> Agent:
    """The agent ``spec`` names, checked: it exists, is a function (or a callable instance, not a
    class) and takes ``(row, base_url, model)`` positionally; else a ConfigError naming the fix."""
    what = f"rollout.agent={spec!r}"
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{what} is not an agent path; {FORM}, e.g. 'agents/calc.py:solve'.")
    fn = load_object(spec, what)
    name = spec.rpartition(":")[2]
    if isinstance(fn, type):
        raise ConfigError(
            f"{what}: '{name}' is a class; rollout.agent names a function {SIGNATURE} (an "
            "instance with __call__ works too): the endpoint calls it once per sample"
        )
    if not callable(fn):
        raise ConfigError(
            f"{what}: '{name}' is {type(fn).__name__} {fn!r:.60}, not callable; define "
            f"def {SIGNATURE.replace('NAME', name)}"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing more to check
        signature = None
    if signature is not None:
        try:
            signature.bind(*PARAMETERS)
        except TypeError as e:
            raise ConfigError(
                f"{what}: '{name}{signature}' cannot be called as {name}(row, base_url, model) "
                f"({e}); define def {SIGNATURE.replace('NAME', name)}"
            ) from None
    return Agent(fn=fn, spec=spec, is_async=_is_async(fn))
