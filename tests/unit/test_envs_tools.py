"""Tools: schemas from signatures, argument checks, the tool-call parsers of each family, the
calculator, and the bounded pool (concurrency cap, timeouts, errors, output cut)."""

from __future__ import annotations

import asyncio
import time

import pytest

from megarl.envs import TOOL_PARSERS, ToolCall, ToolError, ToolPool, tool
from megarl.envs.builtin_tools import evaluate
from megarl.errors import ConfigError

pytestmark = pytest.mark.unit


def lookup(city: str, days: int = 1, units: list[str] | None = None) -> str:
    """Look up the weather.

    Args:
        city: The city's name.
        days: How many days ahead.
        units: Units to report in.
    """
    return f"{city}: sunny for {days} day(s)"


def test_schema_comes_from_the_signature_and_docstring():
    t = tool(lookup)
    fn = t.schema["function"]
    assert t.schema["type"] == "function" and t.name == "lookup"
    assert fn["description"] == "Look up the weather."
    props = fn["parameters"]["properties"]
    assert props["city"] == {"type": "string", "description": "The city's name."}
    assert props["days"]["type"] == "integer"
    assert props["units"]["type"] == "array" and props["units"]["items"] == {"type": "string"}
    assert fn["parameters"]["required"] == ["city"]
    assert tool(name="weather")(lookup).name == "weather"

    def untyped(x):
        """No hints."""

    with pytest.raises(ConfigError, match="type hint"):
        tool(untyped)


def test_arguments_are_checked_against_the_schema():
    t = tool(lookup)
    assert t.check_arguments({"city": "Oslo", "days": 2}) is None
    assert "missing argument(s) ['city']" in t.check_arguments({"days": 2})
    assert "unknown argument(s) ['when']" in t.check_arguments({"city": "Oslo", "when": 1})
    assert "must be integer" in t.check_arguments({"city": "Oslo", "days": "2"})
    assert "must be integer" in t.check_arguments({"city": "Oslo", "days": True})


def test_hermes_parser():
    parse = TOOL_PARSERS.get("hermes")
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n'
        '</tool_call>\n<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}'
        "</tool_call>"
    )
    parsed = parse(text)
    assert parsed.calls == [
        ToolCall("calculator", {"expression": "1+2"}),
        ToolCall("python", {"code": "print(1)"}),  # arguments given as a JSON string
    ]
    assert not parsed.errors
    listed = parse('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b"}]</tool_call>')
    assert [c.name for c in listed.calls] == ["a", "b"] and listed.calls[1].arguments == {}
    assert parse("The answer is 3.").attempted == 0
    bad = parse('<tool_call>{"name": "a", "arguments": {oops}}</tool_call>')
    assert not bad.calls and "not valid JSON" in bad.errors[0]
    assert 'needs a string "name"' in parse('<tool_call>{"arguments": {}}</tool_call>').errors[0]
    assert "not closed" in parse('<tool_call>{"name": "a"').errors[0]
    assert (
        "must be a JSON object"
        in parse('<tool_call>{"name": "a", "arguments": 3}</tool_call>').errors[0]
    )


def test_llama3_and_mistral_parsers():
    llama = TOOL_PARSERS.get("llama3_json")
    parsed = llama('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2*3"}}')
    assert parsed.calls == [ToolCall("calculator", {"expression": "2*3"})]
    assert llama("Six.").attempted == 0
    two = llama('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert [c.name for c in two.calls] == ["a", "b"]
    mistral = TOOL_PARSERS.get("mistral")
    assert mistral('[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}]').calls == [
        ToolCall("a", {"x": 1})
    ]


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123 + 456", "579"),
        ("7 / 2", "3.5"),
        ("6/3", "2"),
        ("2^10", "1024"),
        ("(12 + 30) * 4 / 3", "56"),
        ("-5 % 3", "1"),
        ("sqrt(16) + abs(-2)", "6"),
        ("1/3", "0.333333333333"),
        ("987 * 654 =", "645498"),
    ],
)
def test_calculator_values(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1/0", "division by zero"),
        ("10**10**10", "exponents beyond"),
        ("9**999", "numbers past"),
        ("__import__('os')", "unknown function"),
        ("().__class__", "not an arithmetic expression"),
        ("3 x 4", "cannot parse"),
        ("", "empty"),
    ],
)
def test_calculator_refuses(expression, message):
    with pytest.raises(ToolError, match=message):
        evaluate(expression)


def _run(coro):
    return asyncio.run(coro)


def test_pool_caps_concurrency_and_runs_calls_together():
    live = {"now": 0, "peak": 0}

    @tool
    async def wait(seconds: float) -> str:
        """Wait.

        Args:
            seconds: How long.
        """
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])
        await asyncio.sleep(seconds)
        live["now"] -= 1
        return "done"

    pool = ToolPool(max_concurrency=3, timeout_s=5)

    async def many():
        return await asyncio.gather(
            *(pool.call({"wait": wait}, ToolCall("wait", {"seconds": 0.05})) for _ in range(10))
        )

    outcomes = _run(many())
    assert [o.content for o in outcomes] == ["done"] * 10 and all(o.ok for o in outcomes)
    assert live["peak"] == 3  # concurrent, and never more than the cap
    pool.close()


def test_pool_turns_every_failure_into_an_error_result():
    @tool
    def boom(x: int) -> str:
        """Fail.

        Args:
            x: Anything.
        """
        raise RuntimeError(f"bad {x}")

    @tool
    def slow(x: int) -> str:
        """Sleep in a thread.

        Args:
            x: Anything.
        """
        time.sleep(0.5)
        return "late"

    @tool(max_output_chars=10)
    def chatty(x: int) -> str:
        """Talk.

        Args:
            x: Anything.
        """
        return "y" * 100

    tools = {t.name: t for t in (boom, slow, chatty)}
    pool = ToolPool(max_concurrency=2, timeout_s=0.2)

    async def calls():
        return await asyncio.gather(
            pool.call(tools, ToolCall("boom", {"x": 1})),
            pool.call(tools, ToolCall("slow", {"x": 1})),
            pool.call(tools, ToolCall("chatty", {"x": 1})),
            pool.call(tools, ToolCall("nothing", {})),
            pool.call(tools, ToolCall("boom", {"y": 1})),
        )

    raised, late, long, unknown, bad_args = _run(calls())
    assert raised.error == "raised" and raised.content == "error: RuntimeError: bad 1"
    assert late.error == "timeout" and "timed out after 0.2 s" in late.content
    assert long.ok and long.truncated and long.content.startswith("y" * 10 + "\n[... 90 more")
    assert unknown.error == "unknown_tool" and "boom, chatty, slow" in unknown.content
    assert bad_args.error == "bad_arguments"
    pool.close()
