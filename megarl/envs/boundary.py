"""The operating-system boundary model-written code runs behind, chosen by name.

- ``bwrap`` (the default): bubblewrap. The program runs in its own user (uid 65534 inside, no
  capabilities, no further user namespaces), pid, ipc, uts, cgroup, network (none: loopback
  only, its own) and mount namespaces. Its file system is :class:`InterpreterView` read-only
  plus a throwaway in-memory working folder (``/sandbox``, ``SandboxLimits.work_bytes``), its own
  ``/proc`` and a minimal ``/dev``; the root is read-only. A system-call filter
  (:mod:`megarl.envs.seccomp`) keeps it to one process, so its address-space, CPU-time and
  file-size limits bound the whole sandbox, and ending that process (with ``--die-with-parent``
  if the trainer dies) ends everything in it. bwrap needs unprivileged user namespaces, or
  root; :func:`require` probes that once per process and says how to get it.
- ``unsafe_no_boundary``: the program runs as a plain child process with the same resource
  limits, in a new session and a throwaway folder, but with the trainer's user, files, network
  and processes in reach. Only for machines without user namespaces and code you trust; it is
  never chosen by itself, and using it is logged loudly.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from megarl.envs.interpreter_view import InterpreterView
from megarl.envs.sandbox_limits import SandboxLimits
from megarl.envs.seccomp import machine_arch, single_process_filter
from megarl.errors import ConfigError

WORK = "/sandbox"  # the program's working folder in the sandbox (no path shown may be under it)
UNSAFE = "unsafe_no_boundary"
DEFAULT = "bwrap"


class SandboxUnavailable(ConfigError):
    """No operating-system boundary can be made here: the reason and how to get one."""


@dataclass
class Launch:
    """How to start one sandbox: the command (its program's arguments appended), what to pass
    it, and what to close or remove once it has started or ended."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    pass_fds: tuple[int, ...] = ()
    close_after_start: tuple[int, ...] = ()
    info_fd: int | None = None  # read end of bwrap's --info-fd (its sandbox's pid 1)
    cleanup: list[Callable[[], None]] = field(default_factory=list)


class Boundary:
    """A named way to run the sandbox's interpreter."""

    name: str = ""
    isolated: bool = True  # an operating-system boundary (False: the unsafe mode)

    def launch(self, view: InterpreterView, limits: SandboxLimits, program: list[str]) -> Launch:
        raise NotImplementedError


_ENV = {
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}


class Bwrap(Boundary):
    name = "bwrap"
    isolated = True

    def __init__(self, executable: str) -> None:
        self.executable = executable

    def launch(self, view: InterpreterView, limits: SandboxLimits, program: list[str]) -> Launch:
        hidden = [p for p in view.read_only if p == WORK or p.startswith(WORK + "/")]
        if hidden:
            raise SandboxUnavailable(
                f"the sandbox's working folder {WORK} would hide {hidden[0]}, which the "
                "interpreter needs; install Python (or its packages) elsewhere"
            )
        seccomp = os.memfd_create("megarl-seccomp", 0)
        os.write(seccomp, single_process_filter())
        os.lseek(seccomp, 0, os.SEEK_SET)
        info_read, info_write = os.pipe()
        args = [
            self.executable,
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--uid", "65534", "--gid", "65534",
            "--cap-drop", "ALL",
            "--die-with-parent",
            "--new-session",
            "--hostname", "sandbox",
        ]  # fmt: skip
        for path in view.read_only:
            args += ["--ro-bind", path, path]
        for path, target in view.links:
            args += ["--symlink", target, path]
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--size", str(limits.work_bytes), "--perms", "0700", "--tmpfs", WORK]
        args += ["--chdir", WORK, "--remount-ro", "/", "--clearenv"]
        env = dict(_ENV, PATH="/usr/bin:/bin", HOME=WORK, TMPDIR=WORK)
        for key, value in env.items():
            args += ["--setenv", key, value]
        args += ["--info-fd", str(info_write), "--seccomp", str(seccomp), "--", *program]
        return Launch(
            argv=args,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            cwd="/",
            pass_fds=(seccomp, info_write),
            close_after_start=(seccomp, info_write),
            info_fd=info_read,
        )


class UnsafeProcess(Boundary):
    name = UNSAFE
    isolated = False

    def launch(self, view: InterpreterView, limits: SandboxLimits, program: list[str]) -> Launch:
        work = tempfile.mkdtemp(prefix="megarl-sandbox-")
        env = dict(_ENV, PATH="/usr/bin:/bin", HOME=work, TMPDIR=work)
        return Launch(
            argv=program,
            env=env,
            cwd=work,
            cleanup=[lambda: shutil.rmtree(work, ignore_errors=True)],
        )


BWRAP_FIX = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; RHEL/Fedora: dnf install "
    "bubblewrap; conda: conda install -c conda-forge bubblewrap) and allow unprivileged user "
    "namespaces (sysctl kernel.unprivileged_userns_clone=1 on Debian kernels, "
    "user.max_user_namespaces > 0; Ubuntu 24.04+: an AppArmor profile that lets bwrap make them, "
    "as the bubblewrap package installs), or run in a container started with them allowed; see "
    "docs/security.md. To run model-written code without a boundary anyway (your own machine, "
    f"code you trust), name rollout.env_kwargs.sandbox={UNSAFE}"
)


def _probe_bwrap() -> Boundary:
    arch = machine_arch()
    try:
        single_process_filter(arch)
    except ValueError as e:
        raise SandboxUnavailable(f"the python tool's sandbox cannot be made here: {e}") from None
    exe = shutil.which("bwrap")
    if exe is None:
        raise SandboxUnavailable(
            "the python tool runs model-written code behind bubblewrap, and no `bwrap` is on "
            f"PATH; {BWRAP_FIX}"
        )
    boundary = Bwrap(exe)
    launch = boundary.launch(
        InterpreterView.current(), SandboxLimits(), [InterpreterView.current().executable, "-I",
        "-S", "-c", "import os; print(os.getuid())"]
    )  # fmt: skip
    try:
        done = subprocess.run(
            launch.argv,
            env=launch.env,
            cwd=launch.cwd,
            pass_fds=launch.pass_fds,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxUnavailable(f"bubblewrap ({exe}) did not run: {e}; {BWRAP_FIX}") from None
    finally:
        for fd in (*launch.close_after_start, *([launch.info_fd] if launch.info_fd else [])):
            with contextlib.suppress(OSError):
                os.close(fd)
    if done.returncode != 0 or done.stdout.strip() != "65534":
        reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise SandboxUnavailable(
            f"bubblewrap ({exe}) cannot make the python tool's sandbox here: {reason}; {BWRAP_FIX}"
        )
    return boundary


def _warn_unsafe() -> Boundary:
    print(
        f"megarl: WARNING: {UNSAFE}: model-written code runs WITHOUT an operating-system "
        "boundary, with this process's user, files, network and processes in reach "
        "(rollout.env_kwargs.sandbox names this mode); use it only for code you trust",
        file=sys.stderr,
        flush=True,
    )
    return UnsafeProcess()


BOUNDARIES: dict[str, Callable[[], Boundary]] = {DEFAULT: _probe_bwrap, UNSAFE: _warn_unsafe}


@functools.cache
def require(name: str = DEFAULT) -> Boundary:
    """The boundary ``name`` names, checked once per process: SandboxUnavailable (a ConfigError)
    says why it cannot be made and how to get it; an unknown name lists the known ones."""
    make = BOUNDARIES.get(name)
    if make is None:
        raise ConfigError(
            f"unknown sandbox {name!r}; known: {', '.join(BOUNDARIES)} ({DEFAULT} is the "
            "operating-system boundary; the other runs code with the trainer's rights)"
        )
    return make()
