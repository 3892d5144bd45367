""":class:`ToolEnvironment`: an environment whose only job is running the model's tool calls.

Each model turn is parsed for tool calls (``parser``: the model family's format, see
:mod:`megarl.envs.tool_parsers`); the calls run concurrently in the rollout's bounded pool and
their results come back as ``tool`` messages, one per call, in order. A turn without a tool call
is the final answer: the trajectory ends and the run's reward (rule scorer or reward model)
scores it. Calls past ``max_tool_calls`` in one turn are refused with an error result.

Chosen as ``rollout.env="megarl.envs:ToolEnvironment"`` with ``rollout.env_kwargs``, e.g.
``{tools: [calculator], parser: hermes, system_prompt: "..."}``; tools are built-in names
(``calculator``, ``python``) or "module:function" / "file.py:function" specs of typed functions.
``sandbox``: the boundary the built-in tools that run model-written code (``python``) run
behind (megarl.envs.boundary: ``bwrap``, or ``unsafe_no_boundary`` named explicitly); a run
checks it can be made before any model is built. ``examples``: demonstration messages placed
between the system message and the row's prompt (few-shot); ``call_reward`` / ``attempt_reward``: credits for the first turn that calls a tool,
when all its calls succeed / when not. Subclass it
for other rewards per turn (override :meth:`turn_reward`) or another prompt.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence

from megarl.data.chat import to_messages
from megarl.envs.base import Environment, Message, Step, check_messages
from megarl.envs.boundary import DEFAULT, require
from megarl.envs.builtin_tools import BUILTIN_TOOLS, CODE_TOOLS
from megarl.envs.pool import ToolOutcome, ToolPool
from megarl.envs.tool_parsers import TOOL_PARSERS, ParsedTurn, parse_contained
from megarl.envs.tools import Tool, ToolCall, as_tool
from megarl.errors import ConfigError
from megarl.rewards.loading import load_callable

# How each registered format asks for a call, for templates that do not render tools themselves.
CALL_FORMATS = {
    "hermes": '<tool_call>\n{"name": "TOOL_NAME", "arguments": {"ARG": "VALUE"}}\n</tool_call>',
    "llama3_json": '{"name": "TOOL_NAME", "parameters": {"ARG": "VALUE"}}',
    "mistral": '[TOOL_CALLS] [{"name": "TOOL_NAME", "arguments": {"ARG": "VALUE"}}]',
}

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant that can call tools.{tools}\n\n"
    "To call a tool, reply with only this, filled in:\n{call_format}\n"
    "The tool's result comes back in the next message. When you have the answer, reply with it "
    "and no tool call."
)


def resolve_tools(
    specs: Sequence[Tool | Callable[..., object] | str], sandbox: str = DEFAULT
) -> list[Tool]:
    """Tools from built-in names, "module:function" specs, functions or Tool objects; built-ins
    that run model-written code run behind ``sandbox``."""
    out = []
    for spec in specs:
        if isinstance(spec, str):
            if spec in CODE_TOOLS:
                out.append(CODE_TOOLS[spec](sandbox=sandbox))
                continue
            if spec in BUILTIN_TOOLS:
                out.append(BUILTIN_TOOLS[spec]())
                continue
            if ":" not in spec:
                raise ConfigError(
                    f"unknown tool {spec!r}: built-in tools are {sorted(BUILTIN_TOOLS)}, or give "
                    "'module:function' / 'path/to/file.py:function'"
                )
            spec = load_callable(spec, what="tool", name="function")
        out.append(as_tool(spec))
    names = [t.name for t in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"tools {dupes} are given more than once")
    return out


class ToolEnvironment(Environment):
    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., object] | str] = ("calculator",),
        parser: str = "hermes",
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        max_tool_calls: int = 4,
        examples: Sequence[Message] = (),
        call_reward: float = 0.0,
        attempt_reward: float = 0.0,
        sandbox: str = DEFAULT,
    ) -> None:
        self.tools = {t.name: t for t in resolve_tools(tools, sandbox)}
        if parser not in TOOL_PARSERS:
            raise ConfigError(
                f"unknown tool-call parser {parser!r}; known: {', '.join(TOOL_PARSERS.names())} "
                "(megarl.envs.register_tool_parser adds one)"
            )
        if max_tool_calls < 1:
            raise ConfigError(f"max_tool_calls must be >= 1, got {max_tool_calls}")
        self.parser = parser
        self.parse = TOOL_PARSERS.get(parser)
        self.system_prompt = system_prompt
        self.max_tool_calls = max_tool_calls
        self.examples = check_messages(list(examples), where="ToolEnvironment(examples=...)")
        self.call_reward = float(call_reward)
        self.attempt_reward = float(attempt_reward)
        self._rewarded_call = False

    @classmethod
    def check_settings(cls, kwargs: Mapping[str, object]) -> None:
        """Before any model is built: the sandbox of the built-in code tools can be made here
        (SandboxUnavailable says why not and what to do)."""
        tools = kwargs.get("tools", ())
        names = [t for t in tools if isinstance(t, str)] if isinstance(tools, Sequence) else []
        if any(n in CODE_TOOLS for n in names):
            require(str(kwargs.get("sandbox", DEFAULT)))

    # -- the conversation ----------------------------------------------------------------------
    def tool_schemas(self) -> list[dict[str, object]] | None:
        return [t.schema for t in self.tools.values()] or None

    def system_message(self) -> str | None:
        """The system prompt; it lists the tools itself when the chat template cannot."""
        if self.system_prompt is None:
            return None
        listed = ""
        if not self.context.template_renders_tools and self.tools:
            lines = [json.dumps(t.schema["function"]) for t in self.tools.values()]
            listed = "\n\nTools:\n" + "\n".join(lines)
        return self.system_prompt.format(
            tools=listed, call_format=CALL_FORMATS.get(self.parser, "")
        )

    def reset(self, row: dict[str, object]) -> list[Message]:
        prompt = to_messages(row["prompt"], where="ToolEnvironment.reset", column="prompt")
        system = self.system_message()
        head: list[Message] = []
        if prompt and prompt[0]["role"] == "system":  # the row's own system text comes after
            own, prompt = prompt[0]["content"], prompt[1:]
            system = own if system is None else system + "\n\n" + own
        if system is not None:
            head.append({"role": "system", "content": system})
        return [*head, *(dict(m) for m in self.examples), *prompt]

    # -- a turn --------------------------------------------------------------------------------
    def turn_reward(self, parsed: ParsedTurn, outcomes: list[ToolOutcome]) -> float | None:
        """The reward of a turn that calls a tool: the shaping credit, given once per trajectory
        to its first such turn (``call_reward`` when every call ran without error, else
        ``attempt_reward``: a call was written but is malformed or failed), else 0.

        Never None: a turn that calls a tool is not an answer. A trajectory cut at
        ``rollout.environment.max_turns`` on such a turn thus keeps its credits and nothing more, where the
        run's scorer would otherwise read the call as the final answer (a measured reward hack:
        calling the calculator on the answer, ``{"expression": "1382"}``, scores as answering
        1382). The final answer's turn (no call) is left unrewarded, so the run's reward scores
        it."""
        if self._rewarded_call or not (self.call_reward or self.attempt_reward):
            return 0.0
        self._rewarded_call = True
        if not parsed.errors and outcomes and all(o.ok for o in outcomes):
            return self.call_reward
        return self.attempt_reward

    # Environment.step may be a coroutine function: the runner awaits it (megarl/envs/base.py).
    async def step(self, messages: list[Message]) -> Step:  # type: ignore[override]
        parsed = parse_contained(self.parse, messages[-1]["content"])
        if not parsed.attempted:
            return Step(done=True, metrics={"tool_calls": 0.0})
        pool = self.context.pool or ToolPool()
        calls = parsed.calls[: self.max_tool_calls]
        over = len(parsed.calls) - len(calls)
        outcomes = list(await asyncio.gather(*(pool.call(self.tools, c) for c in calls)))
        results = [_message(c, o) for c, o in zip(calls, outcomes, strict=True)]
        errors = [{"role": "tool", "content": f"error: {e}"} for e in parsed.errors]
        refused = [
            {"role": "tool", "content": f"error: at most {self.max_tool_calls} tool calls per turn"}
        ] * over
        metrics = {
            "tool_calls": float(parsed.attempted),
            "tool_errors": float(sum(not o.ok for o in outcomes) + len(errors) + over),
            "tool_s": float(sum(o.seconds for o in outcomes)),
            "tool_truncated": float(sum(o.truncated for o in outcomes)),
            "tool_malformed": float(len(errors)),
        }
        return Step(
            messages=results + errors + refused,
            reward=self.turn_reward(parsed, outcomes),
            metrics=metrics,
        )


def _message(call: ToolCall, outcome: ToolOutcome) -> Message:
    return {"role": "tool", "name": call.name, "content": outcome.content}
