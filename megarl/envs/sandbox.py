"""Python code execution behind an operating-system boundary: one fresh sandbox per call.

Each call runs the program in a sandbox of its own (megarl.envs.boundary: bubblewrap by
default), with:

- its own user (uid 65534 inside, no capabilities), pid, ipc, network (none) and mount
  namespaces; a read-only view of the interpreter and the system's shared libraries only
  (megarl.envs.interpreter_view), a throwaway in-memory working folder, its own ``/proc``;
- one process (a system-call filter refuses new ones; threads are allowed), so the CPU-time,
  address-space and file-size limits (``setrlimit`` before the program runs) are the whole
  sandbox's;
- a wall-clock limit kept by the caller, stdout and stderr kept up to ``output_bytes`` each;
- nothing left behind: the call returns once the sandbox's process namespace is gone.

``ready`` keeps that many sandboxes started ahead (megarl.envs.sandbox_pool): each still runs
exactly one program. Where no boundary can be made, :func:`megarl.envs.boundary.require`
raises with the reason and the fix; ``sandbox="unsafe_no_boundary"`` runs the code as a plain
child process instead, with the trainer's rights (loudly logged).
"""

from __future__ import annotations

import asyncio
import functools

from megarl.envs.boundary import DEFAULT, require
from megarl.envs.interpreter_view import InterpreterView
from megarl.envs.sandbox_limits import SandboxLimits, SandboxResult
from megarl.envs.sandbox_pool import ready_sandboxes
from megarl.envs.sandbox_process import SandboxProcess

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "run_python_async", "start_sandbox"]


@functools.cache
def _view(packages: bool) -> InterpreterView:
    return InterpreterView.current(packages)


def start_sandbox(
    limits: SandboxLimits, *, sandbox: str = DEFAULT, packages: bool = False, ready: int = 0
) -> SandboxProcess:
    """A started sandbox, from the ready pool when ``ready`` > 0 (the pool refills itself)."""
    boundary = require(sandbox)
    view = _view(packages)
    if ready > 0:
        return ready_sandboxes(boundary, view, limits, ready).take()
    return SandboxProcess(boundary, view, limits).start()


async def run_python_async(
    code: str,
    limits: SandboxLimits | None = None,
    *,
    sandbox: str = DEFAULT,
    packages: bool = False,
    ready: int = 0,
) -> SandboxResult:
    """Run ``code`` in a fresh sandbox; never raises for the code's faults (a sandbox that
    cannot be made raises SandboxUnavailable). Cancelling the call ends its sandbox."""
    limits = limits or SandboxLimits()
    process = start_sandbox(limits, sandbox=sandbox, packages=packages, ready=ready)
    running = asyncio.get_running_loop().run_in_executor(None, process.run, code)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        process.kill()  # run() then sees the end of the sandbox and returns
        raise


def run_python(
    code: str,
    limits: SandboxLimits | None = None,
    *,
    sandbox: str = DEFAULT,
    packages: bool = False,
    ready: int = 0,
) -> SandboxResult:
    """:func:`run_python_async` from synchronous code (not from inside a running event loop)."""
    return asyncio.run(
        run_python_async(code, limits, sandbox=sandbox, packages=packages, ready=ready)
    )
