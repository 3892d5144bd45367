"""Tool-call parsers: the model's turn text -> the tool calls it makes, by model family's format.

Registered by name (``ToolEnvironment(parser=...)``, i.e. ``rollout.env_kwargs.parser``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, as Qwen2.5,
  Qwen3 and Hermes models write them (a JSON list of calls inside one block is accepted too);
- ``llama3_json``: the whole turn is ``{"name": ..., "parameters": {...}}`` (Llama 3.1+), calls
  separated by ``;``, an optional ``<|python_tag|>`` first;
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of calls.

A parser returns the well-formed calls and, for each malformed one, a message the model gets back
as that call's result. ``register_tool_parser("name")`` adds another format. Parsers read model
output, so they are called through :func:`parse_contained`: whatever one raises (a number past
Python's 4,300-digit limit, nesting past the recursion limit, a registered parser's own bug)
becomes one malformed call of that turn, never an exception of the rollout.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from megarl.algos.registry import Registry
from megarl.envs.tools import ToolCall


@dataclass(frozen=True)
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one message per malformed call

    @property
    def attempted(self) -> int:
        return len(self.calls) + len(self.errors)


ToolParser = Callable[[str], ParsedTurn]
TOOL_PARSERS: Registry[ToolParser] = Registry("tool-call parser")
register_tool_parser = TOOL_PARSERS.register


def _call_from(obj: object, args_key: str = "arguments") -> ToolCall | str:
    """A ToolCall from one decoded JSON object, or a message saying what is wrong with it."""
    if not isinstance(obj, dict):
        return f'a tool call must be a JSON object with "name" and "{args_key}", got {obj!r:.80}'
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f'a tool call needs a string "name", got {obj!r:.80}'
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"the arguments of {name[:80]!r} are not valid JSON: {e}"
        except (ValueError, RecursionError) as e:
            return f"the arguments of {name[:80]!r} cannot be read: {_short(e)}"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"the arguments of {name!r} must be a JSON object, got {args!r:.80}"
    return ToolCall(name=name, arguments=args)


def _decode(body: str, parsed: ParsedTurn, args_key: str = "arguments") -> None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        parsed.errors.append(f"the tool call is not valid JSON ({e}): {body.strip()[:120]!r}")
        return
    except (ValueError, RecursionError) as e:  # a number past 4,300 digits, nesting too deep
        parsed.errors.append(f"the tool call cannot be read: {_short(e)}")
        return
    for item in obj if isinstance(obj, list) else [obj]:
        call = _call_from(item, args_key)
        if isinstance(call, ToolCall):
            parsed.calls.append(call)
        else:
            parsed.errors.append(call)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:200]}"


def parse_contained(parse: ToolParser, text: str) -> ParsedTurn:
    """``parse(text)``, or (it raised) one malformed call saying why."""
    try:
        parsed = parse(text)
    except Exception as e:  # model output reached a parser's limit or its bug
        return ParsedTurn(errors=[f"the tool call cannot be read: {_short(e)}"])
    if not isinstance(parsed, ParsedTurn):
        what = type(parsed).__name__
        return ParsedTurn(errors=[f"the tool-call parser returned {what}, not a ParsedTurn"])
    return parsed


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@register_tool_parser("hermes")
def hermes(text: str) -> ParsedTurn:
    parsed = ParsedTurn()
    for body in _HERMES_BLOCK.findall(text):
        _decode(body, parsed)
    tail = _HERMES_BLOCK.sub("", text)
    if "<tool_call>" in tail:
        parsed.errors.append("a <tool_call> block is not closed with </tool_call>")
    return parsed


@register_tool_parser("llama3_json")
def llama3_json(text: str) -> ParsedTurn:
    parsed = ParsedTurn()
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return parsed  # a plain answer
    for part in body.split(";"):
        if part.strip():
            _decode(part, parsed, args_key="parameters")
    return parsed


@register_tool_parser("mistral")
def mistral(text: str) -> ParsedTurn:
    parsed = ParsedTurn()
    marker = "[TOOL_CALLS]"
    if marker not in text:
        return parsed
    _decode(text.split(marker, 1)[1], parsed)
    return parsed


# The turn's text once its tool calls are taken out, per format: what an OpenAI-style reply
# carries as its content beside ``tool_calls`` (megarl.agents). A format not listed keeps its text.
_TEXT_WITHOUT_CALLS: dict[str, Callable[[str], str]] = {
    "hermes": lambda text: re.sub(
        r"\s*<tool_call>.*?</tool_call>\s*", "\n", text, flags=re.DOTALL
    ).strip(),
    "mistral": lambda text: text.split("[TOOL_CALLS]", 1)[0].strip(),
    "llama3_json": lambda text: "",
}


def text_without_calls(parser: str, text: str) -> str:
    """``text`` without the tool calls that the ``parser`` format writes."""
    return _TEXT_WITHOUT_CALLS.get(parser, str)(text)
