"""The bounded pool tool calls and synchronous environment steps run in.

Tool calls of a turn (every call of every active trajectory) start together and run
concurrently, at most ``max_concurrency`` at a time: ``async def`` tools on the rollout's event
loop, plain functions in worker threads. A call past ``timeout_s``, one that raises, and one the
tool cannot take (unknown name, bad arguments) all give the model an error message as the call's
result, and are counted; none of them ends the run. A plain function still running at its
timeout cannot be stopped (its thread finishes on its own): code that may hang belongs in the
sandboxed Python tool, which is killed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from megarl.envs.tools import Tool, ToolCall, ToolError

T = TypeVar("T")


@dataclass(frozen=True)
class ToolOutcome:
    """A call's result as the model reads it, and how it went."""

    content: str
    error: str | None  # None: ok; else unknown_tool | bad_arguments | raised | timeout
    seconds: float
    truncated: bool  # the result was longer than the tool's max_output_chars and was cut

    @property
    def ok(self) -> bool:
        return self.error is None


def cut(text: str, limit: int) -> tuple[str, bool]:
    """``text`` within ``limit`` characters (a note says how much was cut)."""
    if len(text) <= limit:
        return text, False
    return text[:limit] + f"\n[... {len(text) - limit} more characters cut]", True


class ToolPool:
    def __init__(self, max_concurrency: int = 8, timeout_s: float = 30.0) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="megarl-tool")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None

    def _slots(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._loop is not loop:
            self._loop, self._semaphore = loop, asyncio.Semaphore(self.max_concurrency)
        return self._semaphore

    async def in_thread(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in one of the pool's threads (a synchronous environment step)."""
        async with self._slots():
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def call(self, tools: Mapping[str, Tool], call: ToolCall) -> ToolOutcome:
        """Run one parsed call against ``tools``; never raises for the tool's faults."""
        tool = tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(tools)) or "none"
            return ToolOutcome(
                f"error: unknown tool {call.name!r} (tools: {known})", "unknown_tool", 0.0, False
            )
        try:
            problem = tool.check_arguments(call.arguments)
        except Exception as e:  # arguments a custom parser made that the check cannot print
            problem = f"the arguments cannot be checked ({type(e).__name__})"
        if problem is not None:
            return ToolOutcome(f"error: {problem}", "bad_arguments", 0.0, False)
        t0 = time.perf_counter()
        error: str | None = None
        async with self._slots():
            try:
                if tool.is_async:
                    result = await asyncio.wait_for(tool.fn(**call.arguments), self.timeout_s)
                else:
                    loop = asyncio.get_running_loop()
                    job = loop.run_in_executor(self._executor, lambda: tool.fn(**call.arguments))
                    result = await asyncio.wait_for(job, self.timeout_s)
                text = result if isinstance(result, str) else _as_text(result)
            except TimeoutError:
                text, error = f"error: {call.name} timed out after {self.timeout_s:g} s", "timeout"
            except ToolError as e:
                text, error = f"error: {e}", "raised"
            except Exception as e:  # a tool's bug: the model reads it, the run goes on
                text, error = f"error: {type(e).__name__}: {e}", "raised"
        content, truncated = cut(text, tool.max_output_chars)
        return ToolOutcome(content, error, time.perf_counter() - t0, truncated)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _as_text(value: object) -> str:

    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
