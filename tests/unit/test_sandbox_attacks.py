"""Model-written code tries to leave the python tool's sandbox, as an attacker would; each attempt
is watched from the host (a listener that must get no connection, a file that must stay
untouched, a process that must not outlive the call), never from what the code reports.

Each program first disables the in-process audit hook (one line rebinds its code), so what holds
is the operating-system boundary alone."""

from __future__ import annotations

import ast
import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megarl.envs import SandboxLimits, run_python

pytestmark = pytest.mark.unit

LIMITS = SandboxLimits(cpu_s=2, wall_s=60, memory_bytes=256 << 20, output_bytes=4000)

# What an attacker writes first: every audit hook written in Python (a function of
# (event, args) defined outside a file) gets the code of one that does nothing.
UNHOOK = textwrap.dedent(
    """
    import gc, types
    for _f in gc.get_objects():
        if isinstance(_f, types.FunctionType) and _f.__code__.co_filename == "<string>" \\
                and _f.__code__.co_argcount == 2:
            _f.__code__ = (lambda event, args: None).__code__
    """
)


def attack(body: str) -> str:
    return UNHOOK + textwrap.dedent(body)


def listener() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.setblocking(False)
    return s, s.getsockname()[1]


def assert_no_connection(s: socket.socket) -> None:
    with pytest.raises(BlockingIOError):  # nothing ever connected
        s.accept()
    s.close()


def test_a_disabled_hook_still_gives_no_shell_no_network_no_processes_no_signals(tmp_path):
    marker = tmp_path / "shell-ran"
    s, port = listener()
    result = run_python(
        attack(
            f"""
            import os, socket
            try:
                os.system("touch {marker}")
            except Exception as e:
                print("system:", type(e).__name__)
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
                print("connected")
            except Exception as e:
                print("socket:", type(e).__name__)
            try:
                pid = os.fork()
                if pid == 0:
                    os._exit(0)
                os.waitpid(pid, 0)
                print("forked")
            except Exception as e:
                print("fork:", type(e).__name__)
            try:
                os.kill({os.getpid()}, 0)
                print("signalled the trainer")
            except Exception as e:
                print("kill:", type(e).__name__)
            """
        ),
        LIMITS,
    )
    assert not marker.exists(), result
    assert_no_connection(s)
    assert "forked" not in result.stdout and "signalled" not in result.stdout, result


def test_no_file_outside_is_created_by_rename_link_or_dir_fd(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    result = run_python(
        attack(
            f"""
            import os
            open("a.txt", "w").write("a")
            open("b.txt", "w").write("b")
            for name, go in (
                ("rename", lambda: os.rename("a.txt", "{outside}/renamed.pth")),
                ("link", lambda: os.link("b.txt", "{outside}/linked.pth")),
            ):
                try:
                    go()
                except Exception as e:
                    print(name, type(e).__name__)
            try:
                d = os.open("{outside}", os.O_RDONLY)
                fd = os.open("planted.pth", os.O_CREAT | os.O_WRONLY, dir_fd=d)
                os.write(fd, b"import os")
            except Exception as e:
                print("dir_fd", type(e).__name__)
            """
        ),
        LIMITS,
    )
    assert sorted(p.name for p in outside.iterdir()) == [], result


def test_host_files_and_the_trainers_environment_and_memory_are_out_of_sight(tmp_path, monkeypatch):
    secret = "megarl-test-secret-7f3a"
    monkeypatch.setenv("MEGARL_TEST_SECRET", secret)
    (tmp_path / "secret.txt").write_text(secret)
    pid = os.getpid()
    result = run_python(
        attack(
            f"""
            import os
            for path in ("{tmp_path}/secret.txt", "/proc/{pid}/environ", "/proc/{pid}/cmdline"):
                try:
                    print("READ", path, open(path, "rb").read().decode(errors="replace"))
                except Exception as e:
                    print(path, type(e).__name__)
            try:
                f = open("/proc/{pid}/mem", "r+b")
                print("trainer memory writable")
            except Exception as e:
                print("mem", type(e).__name__)
            for folder in ("/root", "/home", "{Path.cwd()}"):
                try:
                    print("LISTED", folder, os.listdir(folder))
                except Exception as e:
                    print(folder, type(e).__name__)
            """
        ),
        LIMITS,
    )
    assert secret not in result.stdout and secret not in result.stderr, result
    assert "trainer memory writable" not in result.stdout, result
    assert "READ" not in result.stdout, result  # neither the file nor the trainer's /proc
    assert "pyproject.toml" not in result.stdout, result  # the project's folder
    interpreter = set(Path(sys.executable).resolve().parts)
    for line in result.stdout.splitlines():  # a folder shows at most the interpreter's path
        if line.startswith("LISTED "):
            entries = ast.literal_eval(line.split(" ", 2)[2])
            assert set(entries) <= interpreter, line


def _processes_with(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_nothing_the_call_started_outlives_it_and_processes_are_bounded():
    token = f"megarl-daemon-{os.getpid()}-{time.monotonic_ns()}"
    result = run_python(
        attack(
            f"""
            import os, sys, time
            started = 0
            for i in range(12):
                try:
                    pid = os.fork()
                except Exception as e:
                    print("fork", type(e).__name__)
                    break
                if pid == 0:
                    os.setsid()  # its own session, its output away from the call's pipes
                    null = os.open("/dev/null", os.O_RDWR)
                    for fd in (0, 1, 2):
                        os.dup2(null, fd)
                    try:
                        os.execv(sys.executable, [sys.executable, "-c",
                                 "import time; time.sleep(600)  # {token}"])
                    finally:
                        os._exit(0)
                started += 1
            print("started", started)
            """
        ),
        LIMITS,
    )
    time.sleep(0.5)
    left = _processes_with(token)
    for pid in left:  # leave the machine clean whatever the outcome
        os.kill(pid, 9)
    assert left == [], result
    assert "started 0" in result.stdout, result  # not even one process beyond the program


def test_forked_children_cannot_multiply_the_memory_limit():
    result = run_python(
        attack(
            """
            import os, time
            held = 0
            for i in range(6):
                try:
                    pid = os.fork()
                except Exception:
                    break
                if pid == 0:
                    block = bytearray(150 << 20)  # within one process's 256 MiB limit
                    time.sleep(3)
                    os._exit(0)
                held += 150
            print("held MiB", held)
            """
        ),
        LIMITS,
    )
    assert "held MiB 0" in result.stdout, result


def test_no_way_into_the_trainers_network_or_its_unix_sockets(tmp_path):
    s, port = listener()
    path = tmp_path / "service.sock"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(path))
    unix.listen(4)
    unix.setblocking(False)
    pid = os.getpid()
    result = run_python(
        attack(
            f"""
            import ctypes, os, socket
            try:
                fd = os.open("/proc/{pid}/ns/net", os.O_RDONLY)
                libc = ctypes.CDLL(None, use_errno=True)
                print("setns", libc.setns(fd, 0x40000000), ctypes.get_errno())
                socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
                print("reached the trainer's loopback")
            except Exception as e:
                print("netns", type(e).__name__)
            try:
                c = socket.socket(socket.AF_UNIX)
                c.connect("{path}")
                print("reached the unix socket")
            except Exception as e:
                print("unix", type(e).__name__)
            """
        ),
        LIMITS,
    )
    assert "reached" not in result.stdout, result
    assert_no_connection(s)
    with pytest.raises(BlockingIOError):
        unix.accept()
    unix.close()
