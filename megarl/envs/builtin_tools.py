"""The built-in tools: a calculator and sandboxed Python (by name in ``ToolEnvironment(tools=...)``).

- ``calculator``: arithmetic on exact rationals (``+ - * / // % **``, parentheses, ``^`` as a
  power, and ``sqrt abs round min max floor ceil log exp``); no names, no attribute access, no
  unbounded powers.
- ``python``: runs a program in :mod:`megarl.envs.sandbox` (behind an operating-system
  boundary) and returns what it prints.

:data:`CODE_TOOLS` names the built-ins that run model-written code: a run that lists one checks
before any model is built that its sandbox can be made here (megarl.envs.boundary.require).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from fractions import Fraction

from megarl.envs.boundary import DEFAULT, require
from megarl.envs.sandbox import SandboxLimits, run_python_async
from megarl.envs.tools import Tool, ToolError, tool
from megarl.errors import ConfigError

MAX_DIGITS = 100  # operands and results past 10**100 are refused (no memory bombs)
MAX_EXPONENT = 1000

_BINARY: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_FUNCTIONS: dict[str, Callable] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "exp": math.exp,
}

Number = Fraction | float


def _check_size(value: Number) -> Number:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("the result is not a finite number")
        if abs(value) >= 10.0**MAX_DIGITS:
            raise ToolError(f"numbers past 10**{MAX_DIGITS} are not supported")
        return value
    if abs(value.numerator) >= 10**MAX_DIGITS or value.denominator >= 10**MAX_DIGITS:
        raise ToolError(f"numbers past 10**{MAX_DIGITS} are not supported")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(exponent, Fraction) and exponent.denominator == 1:
        e = int(exponent)
        if abs(e) > MAX_EXPONENT:
            raise ToolError(f"exponents beyond {MAX_EXPONENT} are not supported")
        if isinstance(base, Fraction):
            digits = math.log10(max(abs(base.numerator), base.denominator, 2))
            if digits * abs(e) > MAX_DIGITS:
                raise ToolError(f"numbers past 10**{MAX_DIGITS} are not supported")
            if base == 0 and e < 0:
                raise ToolError("division by zero")
        return base**e
    return float(base) ** float(exponent)


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        if isinstance(node.value, bool):
            raise ToolError("booleans are not numbers here")
        value = node.value
        return _check_size(Fraction(value) if isinstance(value, int) else value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _eval(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        op = _BINARY.get(type(node.op))
        if op is None:
            raise ToolError(f"the operator {type(node.op).__name__} is not supported")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ToolError("division by zero")
        if isinstance(left, float) or isinstance(right, float):
            return _check_size(op(float(left), float(right)))
        return _check_size(Fraction(op(left, right)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        fn = _FUNCTIONS.get(node.func.id)
        if fn is None:
            raise ToolError(f"unknown function {node.func.id!r}; known: {', '.join(_FUNCTIONS)}")
        args = [_eval(a) for a in node.args]
        try:
            result = fn(*[float(a) if fn not in (abs, min, max) else a for a in args])
        except (ValueError, TypeError, OverflowError) as e:
            raise ToolError(f"{node.func.id}: {e}") from None
        return _check_size(Fraction(result) if isinstance(result, int) else result)
    raise ToolError(f"not an arithmetic expression: {ast.unparse(node)!r:.60}")


def format_number(value: Number) -> str:
    """An integer as itself; other rationals and floats to 12 significant digits."""
    if isinstance(value, Fraction) and value.denominator == 1:
        return str(value.numerator)
    as_float = float(value)
    if as_float.is_integer() and abs(as_float) < 1e15:
        return str(int(as_float))
    return f"{as_float:.12g}"


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text (a ToolError says why there is none)."""
    text = expression.strip().rstrip("=").replace("^", "**").replace("×", "*").replace("÷", "/")
    if not text:
        raise ToolError("the expression is empty")
    if len(text) > 500:
        raise ToolError("the expression is longer than 500 characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ToolError(f"cannot parse {expression!r}: {e.msg}") from None
    return format_number(_eval(tree))


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: The arithmetic to compute, e.g. "(12 + 30) * 4 / 3".
    """
    return evaluate(expression)


# Sandboxes started ahead of the python tool's calls, per process (megarl.envs.sandbox_pool):
# bench/results/tool_calls.json measures calls per second with and without them.
DEFAULT_READY = 2


def python_tool(
    limits: SandboxLimits | None = None,
    name: str = "python",
    *,
    sandbox: str = DEFAULT,
    packages: bool = False,
    ready: int = DEFAULT_READY,
) -> Tool:
    """A tool that runs Python code in a sandbox and returns its printed output.

    ``sandbox``: the boundary (megarl.envs.boundary.BOUNDARIES), checked here: a machine where
    it cannot be made raises SandboxUnavailable with the fix. ``packages``: show the
    environment's installed packages (read-only) to the program. ``ready``: sandboxes started
    ahead of the calls."""
    limits = limits or SandboxLimits()
    require(sandbox)
    if ready < 0:
        raise ConfigError(f"python_tool(ready={ready}): the number of ready sandboxes is >= 0")

    async def python(code: str) -> str:
        """Run a Python program in a sandbox and return what it prints.

        Args:
            code: The program; print the values you need, e.g. "print(2**10)".
        """
        result = await run_python_async(
            code, limits, sandbox=sandbox, packages=packages, ready=ready
        )
        out = result.stdout
        if result.truncated:
            out += "\n[output cut]"
        if not result.ok:
            lines = result.stderr.strip().splitlines()[-8:]
            detail = "\n".join(lines)
            raise ToolError(
                f"the program {result.describe(limits)}" + (f"\n{detail}" if detail else "")
            )
        return out if out.strip() else "(the program printed nothing)"

    return tool(python, name=name)


def calculator_tool() -> Tool:
    return tool(calculator)


# Names usable in ToolEnvironment(tools=[...]) (rollout.env_kwargs.tools).
BUILTIN_TOOLS: dict[str, Callable[[], Tool]] = {
    "calculator": calculator_tool,
    "python": python_tool,
}
# The built-ins that run model-written code, by name: their factories take the sandbox
# (ToolEnvironment's ``sandbox``, rollout.env_kwargs.sandbox).
CODE_TOOLS: dict[str, Callable[..., Tool]] = {"python": python_tool}
