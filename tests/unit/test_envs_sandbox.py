"""The sandboxed Python tool: a separate process per call that is killed on an infinite loop,
fails a memory bomb, cannot reach the network, spawn processes or write outside its throwaway
directory, and reports a syntax error; the tool hands each failure to the model as an error."""

from __future__ import annotations

import asyncio
import socket

import pytest

from megarl.envs import SandboxLimits, ToolCall, ToolPool, run_python
from megarl.envs.builtin_tools import python_tool

pytestmark = pytest.mark.unit

# A wall-clock limit far above what these programs need, even on a loaded 2-core machine (the
# interpreter's start counts against it); only the timeout test uses a short one.
LIMITS = SandboxLimits(cpu_s=1, wall_s=60, memory_bytes=256 << 20, output_bytes=1000)
SHORT_WALL = SandboxLimits(cpu_s=1, wall_s=3, memory_bytes=256 << 20, output_bytes=1000)


def test_a_program_runs_and_prints():
    result = run_python("import math\nprint(math.factorial(20))", LIMITS)
    assert result.ok and result.stdout == "2432902008176640000\n" and result.returncode == 0


def test_an_infinite_loop_is_killed():
    busy = run_python("while True:\n    pass", SHORT_WALL)
    assert busy.status in ("cpu_limit", "timeout") and busy.returncode < 0  # killed by a signal
    asleep = run_python("import time\ntime.sleep(600)", SHORT_WALL)
    # killed at its wall limit, not after its sleep (slack for a loaded machine)
    assert asleep.status == "timeout" and asleep.seconds < SHORT_WALL.wall_s + 60


def test_a_memory_bomb_fails_at_the_limit():
    for bomb in (
        "x = bytearray(8 << 30)",
        "parts = []\nwhile True:\n    parts.append(b'x' * 10**7)",
    ):
        result = run_python(bomb, LIMITS)
        assert result.status == "memory_limit" and "MemoryError" in result.stderr, bomb


def test_a_network_attempt_fails_and_reaches_nothing():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    attempts = [
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')",
        f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)",
        "import ctypes\nctypes.CDLL(None).socket(2, 1, 0)",
    ]
    for code in attempts:
        result = run_python(code, LIMITS)
        assert not result.ok and "in" not in result.stdout, code
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):  # no connection ever arrived
        listener.accept()
    listener.close()


def test_no_processes_and_no_writes_outside_the_working_directory(tmp_path):
    outside = tmp_path / "escaped.txt"
    for code in (
        "import os\nos.system('echo hi')",
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.fork()",
        f"open({str(outside)!r}, 'w').write('x')",
    ):
        result = run_python(code, LIMITS)
        assert not result.ok and "PermissionError" in result.stderr, code
    assert not outside.exists()
    inside = run_python(
        "open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())", LIMITS
    )
    assert inside.ok and inside.stdout == "kept\n"


def test_syntax_error_and_output_cut():
    bad = run_python("def f(:\n    pass", LIMITS)
    assert bad.status == "error" and "SyntaxError" in bad.stderr
    loud = run_python("print('z' * 5000)", LIMITS)
    assert loud.ok and loud.truncated and len(loud.stdout) == LIMITS.output_bytes


def test_the_python_tool_gives_the_model_errors_as_results():
    python = python_tool(LIMITS)
    pool = ToolPool(max_concurrency=4, timeout_s=120)  # the sandbox's limits decide

    async def calls():
        return await asyncio.gather(
            pool.call({"python": python}, ToolCall("python", {"code": "print(6 * 7)"})),
            pool.call({"python": python}, ToolCall("python", {"code": "1/0"})),
            pool.call({"python": python}, ToolCall("python", {"code": "while True: pass"})),
            pool.call({"python": python}, ToolCall("python", {"code": "x = 1"})),
        )

    ok, raised, looped, silent = asyncio.run(calls())
    assert ok.ok and ok.content == "42\n"
    assert raised.error == "raised" and "ZeroDivisionError" in raised.content
    assert looped.error == "raised" and ("killed" in looped.content)
    assert silent.ok and silent.content == "(the program printed nothing)"
    pool.close()
