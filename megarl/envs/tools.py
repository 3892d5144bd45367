"""Tools: typed Python functions the model may call, with the JSON schema the chat template shows.

A tool's schema comes from its signature and its Google-style docstring (transformers'
``get_json_schema``: every argument needs a type hint and an ``Args:`` line), so the function is
the single source of truth::

    @tool
    def calculator(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "12 * (3 + 4)".
        \"\"\"

The model's calls are checked against the signature before the function runs; a call that names
an unknown tool or gives wrong arguments gets an error message as its result.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, overload

from megarl.errors import ConfigError

DEFAULT_MAX_OUTPUT_CHARS = 4000

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its arguments (already JSON-decoded)."""

    name: str
    arguments: dict[str, object]


@dataclass(frozen=True)
class Tool:
    """A callable tool: the function (sync or ``async def``), its JSON schema, and the longest
    result (characters) handed back to the model; longer results are cut and counted."""

    fn: Callable[..., Any]  # returns the result, or (is_async) a coroutine of it
    schema: dict[str, Any]
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS

    @property
    def name(self) -> str:
        return str(self.schema["function"]["name"])

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def check_arguments(self, arguments: Mapping[str, object]) -> str | None:
        """Why a call with ``arguments`` cannot run (a message for the model), or None."""
        params = self.schema["function"].get("parameters", {})
        props: dict[str, Any] = params.get("properties", {})
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            return f"unknown argument(s) {unknown} for {self.name}; it takes {sorted(props)}"
        missing = [p for p in params.get("required", []) if p not in arguments]
        if missing:
            return f"missing argument(s) {missing} for {self.name}"
        for key, value in arguments.items():
            want = props[key].get("type")
            kinds = want if isinstance(want, list) else [want] if want else []
            if kinds and not any(_is_json_type(value, k) for k in kinds):
                return f"argument {key!r} of {self.name} must be {' or '.join(kinds)}, got {value!r:.60}"
        return None


def _is_json_type(value: object, kind: str) -> bool:
    types = _JSON_TYPES.get(kind)
    if types is None:
        return True  # a schema type this check does not know: let the function decide
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, types)


def function_schema(fn: Callable[..., object], name: str | None = None) -> dict[str, Any]:
    """The chat-template schema of ``fn`` (``{"type": "function", "function": {...}}``) from its
    type hints and docstring; a ConfigError says what the function lacks."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers raises its own parsing exceptions
        raise ConfigError(
            f"tool {getattr(fn, '__qualname__', fn)!r}: no JSON schema from its signature and "
            f"docstring ({e}); give every argument a type hint and a line under 'Args:' in a "
            "Google-style docstring"
        ) from e
    function = dict(schema["function"])
    function.pop("return", None)  # the model needs the arguments, not the return type
    if name is not None:
        function["name"] = name
    return {"type": "function", "function": function}


@overload
def tool(
    fn: Callable[..., object], *, name: str | None = None, max_output_chars: int = ...
) -> Tool: ...
@overload
def tool(
    fn: None = None, *, name: str | None = None, max_output_chars: int = ...
) -> Callable[[Callable[..., object]], Tool]: ...
def tool(
    fn: Callable[..., object] | None = None,
    *,
    name: str | None = None,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> Tool | Callable[[Callable[..., object]], Tool]:
    """A :class:`Tool` from a typed function; usable bare (``@tool``) or with options
    (``@tool(max_output_chars=1000)``)."""

    def make(f: Callable[..., object]) -> Tool:
        if max_output_chars < 1:
            raise ConfigError(f"tool {f.__qualname__}: max_output_chars must be >= 1")
        return Tool(f, function_schema(f, name), max_output_chars)

    return make(fn) if fn is not None else make


def as_tool(value: Tool | Callable[..., object]) -> Tool:
    """A Tool as it is; a plain typed function made into one."""
    if isinstance(value, Tool):
        return value
    if callable(value):
        return tool(value)
    raise ConfigError(f"{value!r:.80} is not a tool: give a megarl.envs.Tool or a typed function")


class ToolError(Exception):
    """Raised by a tool to hand the model an error message (counted as a tool error)."""
