"""Python code execution in a sandbox: one separate process per call, limited and isolated.

Each call runs ``sys.executable`` in a new session (process group) with:

- CPU time, address space (memory), file size, open files and core dumps capped by
  ``setrlimit`` inside the child before any of the code runs;
- a wall-clock limit enforced by the parent, which kills the whole process group;
- stdout and stderr read up to ``output_bytes`` each (the rest is drained and dropped, counted);
- a throwaway working directory, removed afterwards, and a bare environment;
- no network: a new network namespace (``unshare --net``) where the kernel allows it, and always
  an audit hook (:func:`sys.addaudithook`, which code cannot remove) refusing sockets,
  subprocesses, ``fork``/``exec``, ``ctypes`` and writes outside the working directory;
- when megarl runs as root, the code runs as user ``nobody`` (if that user can read the Python
  installation).

This is a sandbox for model-written code in RL training (bugs, loops, memory bombs, stray network
or file access), not a security boundary against an adversary: run untrusted multi-tenant code
in a container or VM sandbox service instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_bytes: int = 512 << 20
    output_bytes: int = 16 << 10
    file_bytes: int = 16 << 20
    open_files: int = 64

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_bytes", "output_bytes", "file_bytes", "open_files"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    status: str  # ok | error | timeout | cpu_limit | memory_limit
    truncated: bool  # stdout or stderr was longer than the limit and was cut
    seconds: float
    network_isolated: bool  # ran in its own network namespace

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def describe(self, limits: SandboxLimits) -> str:
        """What went wrong, in words for the model (empty when it ran fine)."""
        return {
            "ok": "",
            "timeout": f"timed out after {limits.wall_s:g} s (killed)",
            "cpu_limit": f"exceeded the CPU time limit of {limits.cpu_s} s (killed)",
            "memory_limit": f"exceeded the memory limit of {limits.memory_bytes >> 20} MiB",
            "error": f"exited with status {self.returncode}",
        }[self.status]


# Runs in the child: limits first, then the audit hook, then the code (read from stdin).
_BOOTSTRAP = r"""
import os, resource, sys
cpu, mem, fsize, nofile, drop = (int(a) for a in sys.argv[1:6])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if drop:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
code = sys.stdin.read()
sys.stdin.close()
home = os.path.realpath(os.getcwd())
blocked_modules = {"socket", "_socket", "ssl", "_ssl", "multiprocessing", "_multiprocessing",
                   "pty"}
import _posixsubprocess  # subprocess may be imported (sympy does), never used
def _refuse(*args, **kwargs):
    raise PermissionError("sandbox: starting processes is not allowed")
_posixsubprocess.fork_exec = _refuse
blocked_events = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                  "os.fork", "os.forkpty", "os.kill", "os.killpg", "ctypes.dlsym", "ctypes.cdata",
                  "ctypes.call_function", "os.setuid",
                  "os.setgid", "os.chroot")
path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
               "os.link", "os.symlink", "os.truncate", "os.utime", "shutil.rmtree"}
def inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path)) if not isinstance(path, int) else home
    except Exception:
        return False
    return p == home or p.startswith(home + os.sep)
def hook(event, args):
    if event == "import" and args[0].split(".")[0] in blocked_modules:
        raise PermissionError("sandbox: importing " + args[0] + " is not allowed (no network, no processes)")
    if event == "ctypes.dlopen" and args[0] is not None:  # numpy's import opens None only
        raise PermissionError("sandbox: loading native libraries is not allowed")
    if event.startswith(blocked_events):
        raise PermissionError("sandbox: " + event + " is not allowed")
    if event == "open":
        mode = args[1] or "r"
        writes = isinstance(mode, str) and any(c in mode for c in "wax+")
        if not writes and isinstance(args[2], int):
            writes = bool(args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writes and not inside(args[0]):
            raise PermissionError("sandbox: writing outside the working directory is not allowed")
    elif event in path_events and not inside(args[0]):
        raise PermissionError("sandbox: " + event + " outside the working directory is not allowed")
sys.addaudithook(hook)
del sys.argv[1:]
sys.argv[0] = "main.py"
exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

_NET_PREFIX: list[str] | None = None
_DROP: bool | None = None


def _network_prefix() -> list[str]:
    """``unshare --net`` (as root; else with a user namespace) when the kernel allows it here."""
    global _NET_PREFIX
    if _NET_PREFIX is None:
        _NET_PREFIX = []
        tool = shutil.which("unshare")
        if tool is not None:
            prefix = [tool, "--net"] if os.geteuid() == 0 else [tool, "--net", "--map-root-user"]
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
                if probe.returncode == 0:
                    _NET_PREFIX = prefix
    return _NET_PREFIX


def _drop_privileges() -> bool:
    """Whether the code runs as ``nobody``: when megarl runs as root and ``nobody`` can still
    import the standard library (a Python installed under /root cannot be read by it)."""
    global _DROP
    if _DROP is None:
        _DROP = False
        if os.geteuid() == 0:
            probe = "import decimal, fractions, json, math, statistics"
            args = [sys.executable, "-I", "-c", _BOOTSTRAP, "5", str(512 << 20), "65536", "64", "1"]
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                done = subprocess.run(
                    args, input=probe.encode(), capture_output=True, timeout=30, cwd="/"
                )
                _DROP = done.returncode == 0
    return _DROP


async def _read_capped(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, bool]:
    kept = bytearray()
    cut = False
    while chunk := await stream.read(65536):
        room = limit - len(kept)
        if len(chunk) > room:
            cut = True
        kept += chunk[: max(room, 0)]
    return bytes(kept), cut


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_python_async(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed Python process; never raises for the code's faults."""
    limits = limits or SandboxLimits()
    drop = _drop_privileges()
    prefix = _network_prefix()
    workdir = tempfile.mkdtemp(prefix="megarl-sandbox-")
    if drop:
        os.chmod(workdir, 0o777)
    args = [
        *prefix,
        sys.executable,
        "-I",
        "-c",
        _BOOTSTRAP,
        str(int(limits.cpu_s)),
        str(int(limits.memory_bytes)),
        str(int(limits.file_bytes)),
        str(int(limits.open_files)),
        str(int(drop)),
    ]
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=workdir,
        env=env,
        start_new_session=True,
    )
    timed_out = False
    try:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(code.encode())
            await proc.stdin.drain()
            proc.stdin.close()
        reading = asyncio.ensure_future(
            asyncio.gather(
                _read_capped(proc.stdout, limits.output_bytes),
                _read_capped(proc.stderr, limits.output_bytes),
                proc.wait(),
            )
        )
        done, _ = await asyncio.wait({reading}, timeout=limits.wall_s)
        if not done:
            timed_out = True
            _kill_group(proc.pid)
        (out, out_cut), (err, err_cut), _ = await reading
    finally:
        if proc.returncode is None:
            _kill_group(proc.pid)
            await proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    rc = proc.returncode
    stderr = err.decode(errors="replace")
    if timed_out:
        status = "timeout"
    elif rc in (-signal.SIGXCPU, -signal.SIGKILL):
        status = "cpu_limit"
    elif "MemoryError" in stderr:
        status = "memory_limit"
    elif rc != 0:
        status = "error"
    else:
        status = "ok"
    return SandboxResult(
        stdout=out.decode(errors="replace"),
        stderr=stderr,
        returncode=rc,
        status=status,
        truncated=out_cut or err_cut,
        seconds=time.perf_counter() - t0,
        network_isolated=bool(prefix),
    )


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """:func:`run_python_async` from synchronous code (not from inside a running event loop)."""
    return asyncio.run(run_python_async(code, limits))
