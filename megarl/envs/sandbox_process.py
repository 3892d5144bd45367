"""One sandbox: a started interpreter behind a boundary, waiting for its program on stdin.

:meth:`SandboxProcess.start` starts it (bwrap's set-up and the interpreter's start-up then run
while nothing waits for them); :meth:`SandboxProcess.run` hands it one program, reads its output
within the limits and returns once the sandbox and everything in it is gone. A sandbox runs one
program, never two: nothing of one call reaches the next.

Inside, a short bootstrap sets the resource limits (CPU time, address space, file size, open
files, no core dumps), reads the program and runs it. It also installs an audit hook that turns
attempts to start processes, open sockets or write outside the working folder into clear
``PermissionError`` messages for the model. That hook is a courtesy, not a boundary (code can
remove it): the boundary is the sandbox itself (megarl.envs.boundary).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import time

from megarl.envs.boundary import Boundary
from megarl.envs.interpreter_view import InterpreterView
from megarl.envs.sandbox_limits import SandboxLimits, SandboxResult

_BOOTSTRAP = r"""
import os, resource, sys
cpu, mem, fsize, nofile = (int(a) for a in sys.argv[1:5])
for which, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
                     (resource.RLIMIT_FSIZE, (fsize, fsize)),
                     (resource.RLIMIT_NOFILE, (nofile, nofile)), (resource.RLIMIT_CORE, (0, 0))):
    resource.setrlimit(which, value)
sys.path.extend(sys.argv[5:])
code = sys.stdin.read()
sys.stdin.close()
home = os.path.realpath(os.getcwd())
refused = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
           "os.fork", "os.forkpty")
def inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return p == home or p.startswith(home + os.sep)
def hook(event, args):
    if event.startswith(refused):
        raise PermissionError("sandbox: " + event + " is not allowed (no processes, no network)")
    if event == "open" and not isinstance(args[0], int):
        mode = args[1] or "r"
        writes = isinstance(mode, str) and any(c in mode for c in "wax+")
        if not writes and isinstance(args[2], int):
            writes = bool(args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writes and not inside(args[0]):
            raise PermissionError("sandbox: writing outside the working directory is not allowed")
sys.addaudithook(hook)
del sys.argv[1:]
sys.argv[0] = "main.py"
exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


def _program(view: InterpreterView, limits: SandboxLimits) -> list[str]:
    numbers = (limits.cpu_s, limits.memory_bytes, limits.file_bytes, limits.open_files)
    return [
        view.executable,
        "-I",
        "-S",
        "-c",
        _BOOTSTRAP,
        *(str(int(n)) for n in numbers),
        *view.sys_path,
    ]


class SandboxProcess:
    def __init__(self, boundary: Boundary, view: InterpreterView, limits: SandboxLimits) -> None:
        self.boundary, self.limits = boundary, limits
        self.launch = boundary.launch(view, limits, _program(view, limits))
        self.proc: subprocess.Popen[bytes] | None = None
        self._pid1: int | None = None  # the sandbox's pid 1 (bwrap), once known

    def start(self) -> SandboxProcess:
        launch = self.launch
        try:
            self.proc = subprocess.Popen(
                launch.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=launch.cwd,
                env=launch.env,
                pass_fds=launch.pass_fds,
                start_new_session=True,
            )
        finally:
            for fd in launch.close_after_start:
                os.close(fd)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def run(self, code: str) -> SandboxResult:
        """Run ``code``; returns when the sandbox is gone. Never raises for the code's faults."""
        assert self.proc is not None and self.proc.stdin is not None, "start() it first"
        limits = self.limits
        t0 = time.perf_counter()
        deadline = time.monotonic() + limits.wall_s
        streams = _Streams(self.proc, code.encode(), limits.output_bytes)
        timed_out = False
        try:
            while not streams.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                streams.pump(min(left, 0.5))
            if not timed_out:
                self.proc.wait(timeout=max(deadline - time.monotonic(), 0.001))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            self.close()
            streams.close()
        rc = self.proc.returncode
        if rc is not None and self.boundary.isolated and 128 < rc <= 128 + 64:
            rc = 128 - rc  # bwrap reports a signal N as 128 + N; say it as Popen would
        stderr = streams.err.decode(errors="replace")
        return SandboxResult(
            stdout=streams.out.decode(errors="replace"),
            stderr=stderr,
            returncode=rc,
            status=_status(rc, stderr, timed_out),
            truncated=streams.cut,
            seconds=time.perf_counter() - t0,
            network_isolated=self.boundary.isolated,
            boundary=self.boundary.name,
        )

    def _sandbox_pid1(self) -> int | None:
        """bwrap's pid 1 of the sandbox (from --info-fd); killing it ends the pid namespace."""
        fd = self.launch.info_fd
        if self._pid1 is None and fd is not None:
            os.set_blocking(fd, False)
            with contextlib.suppress(OSError, ValueError, KeyError):
                self._pid1 = int(json.loads(os.read(fd, 65536))["child-pid"])
        return self._pid1

    def kill(self) -> None:
        """End the sandbox now, without waiting (a call that is cancelled: its run() returns)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        pid1 = self._sandbox_pid1()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if pid1 is not None:  # the kernel ends every process of its namespace with it
                os.kill(pid1, signal.SIGKILL)
            else:
                os.killpg(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """End the sandbox (if it still runs) and wait until it and everything in it are gone."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            self.kill()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc is not None and not self.boundary.isolated:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # what the program started, in its session
        for stream in (proc.stdin, proc.stdout, proc.stderr) if proc is not None else ():
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        if self.launch.info_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.launch.info_fd)
            self.launch.info_fd = None
        for clean in self.launch.cleanup:
            clean()
        self.launch.cleanup.clear()


class _Streams:
    """The program's stdin (written), stdout and stderr (read, each kept up to a limit)."""

    def __init__(self, proc: subprocess.Popen[bytes], code: bytes, limit: int) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.limit, self.cut = limit, False
        self.kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        self.out_fd, self.err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        self.pending = memoryview(code)
        self.stdin = proc.stdin
        self.sel = selectors.DefaultSelector()
        for fd in self.kept:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)
        os.set_blocking(proc.stdin.fileno(), False)
        self.sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        self.open = {self.out_fd, self.err_fd, proc.stdin.fileno()}

    @property
    def done(self) -> bool:
        return not self.open

    def pump(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            fd = int(key.fd)
            if fd not in self.kept:
                self._write(fd)
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                self._drop(fd)
                continue
            kept = self.kept[fd]
            room = self.limit - len(kept)
            if len(chunk) > room:
                self.cut = True
            kept += chunk[: max(room, 0)]

    def _write(self, fd: int) -> None:
        try:
            sent = os.write(fd, self.pending[:65536])
            self.pending = self.pending[sent:]
        except BlockingIOError:
            return
        except OSError:  # the program is gone or closed its stdin
            self.pending = self.pending[:0]
        if not self.pending:
            self._drop(fd)
            with contextlib.suppress(OSError):
                self.stdin.close()

    def _drop(self, fd: int) -> None:
        if fd in self.open:
            self.sel.unregister(fd)
            self.open.discard(fd)

    @property
    def out(self) -> bytes:
        return bytes(self.kept[self.out_fd])

    @property
    def err(self) -> bytes:
        return bytes(self.kept[self.err_fd])

    def close(self) -> None:
        self.sel.close()


def _status(rc: int | None, stderr: str, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit"
    if rc == -signal.SIGSYS:
        return "refused"
    if "MemoryError" in stderr:
        return "memory_limit"
    if rc != 0:
        return "error"
    return "ok"
