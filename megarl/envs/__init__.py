"""Multi-turn environments and tools: the :class:`Environment` / :class:`Step` API, tools with JSON
schemas from their signatures, tool-call parsers by model family, the Python tool behind an
operating-system boundary and the calculator, and the chat-template deltas that keep trajectories
as token ids."""

from megarl.envs.base import EnvContext, EnvError, Environment, Message, Step
from megarl.envs.boundary import SandboxUnavailable
from megarl.envs.builtin_tools import BUILTIN_TOOLS, calculator, python_tool
from megarl.envs.chat_deltas import ChatDeltas
from megarl.envs.loading import check_environment, load_environment
from megarl.envs.pool import ToolOutcome, ToolPool
from megarl.envs.sandbox import SandboxLimits, SandboxResult, run_python, run_python_async
from megarl.envs.tool_env import ToolEnvironment
from megarl.envs.tool_parsers import TOOL_PARSERS, ParsedTurn, register_tool_parser
from megarl.envs.tools import Tool, ToolCall, ToolError, function_schema, tool

__all__ = [
    "BUILTIN_TOOLS",
    "TOOL_PARSERS",
    "ChatDeltas",
    "EnvContext",
    "EnvError",
    "Environment",
    "Message",
    "ParsedTurn",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "Step",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolError",
    "ToolOutcome",
    "ToolPool",
    "calculator",
    "check_environment",
    "function_schema",
    "load_environment",
    "python_tool",
    "register_tool_parser",
    "run_python",
    "run_python_async",
    "tool",
]
