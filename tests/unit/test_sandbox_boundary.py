"""The python tool's boundary as a mechanism: the system-call filter's decisions (read by a small
BPF interpreter), the refusal with reason and fix where no sandbox can be made, the unsafe mode
only when named and loudly, the refusal before any model is built, sandboxes started ahead that
still run one program each, a cancelled call that ends its sandbox, and the working folder's
limit."""

from __future__ import annotations

import asyncio
import errno
import struct
import time

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from megarl.envs import SandboxLimits, SandboxUnavailable, ToolCall, ToolPool, run_python
from megarl.envs import boundary as boundary_module
from megarl.envs.builtin_tools import python_tool
from megarl.envs.loading import check_environment
from megarl.envs.sandbox_pool import close_all
from megarl.envs.seccomp import ARCHES, CLONE_THREAD, single_process_filter
from megarl.errors import ConfigError
from tests.unit.test_sandbox_attacks import UNHOOK

pytestmark = pytest.mark.unit

LIMITS = SandboxLimits(cpu_s=2, wall_s=60, memory_bytes=256 << 20, output_bytes=4000)
ALLOW, KILL = 0x7FFF0000, 0x80000000


def run_filter(prog: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """What the classic BPF program returns for one system call (the subset seccomp uses)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack("<HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:  # ret k
            return k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        pc += 1


@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_the_filter_allows_threads_and_nothing_that_makes_a_process(arch):
    a = ARCHES[arch]
    prog = single_process_filter(arch)
    n = a.numbers
    eperm, enosys = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    assert run_filter(prog, n["clone"], a.audit, CLONE_THREAD | 0x3D0F00) == ALLOW  # a thread
    assert run_filter(prog, n["clone"], a.audit, 17) == eperm  # fork's clone (SIGCHLD)
    assert run_filter(prog, n["clone"], a.audit, 0x4111) == eperm  # posix_spawn's vfork clone
    assert run_filter(prog, n["clone3"], a.audit) == enosys  # the C library falls back to clone
    for call in ("fork", "vfork", "unshare", "setns", "mount", "ptrace", "keyctl", "bpf"):
        if call in n:
            assert run_filter(prog, n[call], a.audit) == eperm, call
    assert run_filter(prog, n["socket"], a.audit, 1) == ALLOW  # AF_UNIX
    assert run_filter(prog, n["socket"], a.audit, 2) == KILL  # AF_INET: no network to reach
    assert run_filter(prog, n["socket"], a.audit, 10) == KILL  # AF_INET6
    other = next(x.audit for name, x in ARCHES.items() if name != arch)
    assert run_filter(prog, 0, other) == KILL  # another ABI's calls end the process
    if a.x32:
        assert run_filter(prog, 0x40000000 | 1, a.audit) == KILL
    with pytest.raises(ValueError, match="no system-call filter for the riscv64"):
        single_process_filter("riscv64")


FILTERS = {name: single_process_filter(name) for name in ARCHES}


@given(st.sampled_from(sorted(ARCHES)), st.integers(min_value=0, max_value=460))
def test_every_other_call_is_allowed(arch, nr):
    a = ARCHES[arch]
    if nr not in a.numbers.values():
        assert run_filter(FILTERS[arch], nr, a.audit) == ALLOW


@pytest.fixture
def fresh_probe():
    boundary_module.require.cache_clear()
    yield
    boundary_module.require.cache_clear()


def test_no_bwrap_is_refused_with_the_reason_and_the_fix(fresh_probe, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        SandboxUnavailable,
        match=r"no `bwrap` is on PATH.*apt-get install bubblewrap.*unsafe_no_boundary",
    ):
        boundary_module.require()
    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    boundary_module.require.cache_clear()
    with pytest.raises(
        SandboxUnavailable, match=r"No permissions to create a new namespace.*user namespaces"
    ):
        boundary_module.require()
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        python_tool()  # the tool itself refuses, before any call


def test_a_run_with_the_python_tool_is_refused_before_any_model_is_built(
    fresh_probe, tmp_path, monkeypatch
):
    spec, kwargs = "megarl.envs:ToolEnvironment", {"tools": ["calculator", "python"]}
    check_environment(spec, kwargs)  # bwrap works here
    with pytest.raises(ConfigError, match="unknown sandbox 'nope'"):
        check_environment(spec, {**kwargs, "sandbox": "nope"})
    monkeypatch.setenv("PATH", str(tmp_path))
    boundary_module.require.cache_clear()
    with pytest.raises(
        SandboxUnavailable, match=r"rollout\.env_kwargs\.sandbox=unsafe_no_boundary"
    ):
        check_environment(spec, kwargs)
    check_environment(spec, {"tools": ["calculator"]})  # no code tool: nothing to probe


def test_the_unsafe_mode_runs_only_when_named_and_says_so_loudly(fresh_probe, capfd):
    result = run_python("import os\nprint(os.getpid() > 1)", LIMITS, sandbox="unsafe_no_boundary")
    assert result.ok and result.stdout == "True\n", result
    assert result.boundary == "unsafe_no_boundary" and not result.network_isolated
    assert "WARNING: unsafe_no_boundary" in capfd.readouterr().err
    isolated = run_python("print(1)", LIMITS)
    assert isolated.boundary == "bwrap" and isolated.network_isolated


def _sandboxes() -> list[psutil.Process]:
    """This process's sandboxes (each an outer bwrap, its pid 1 and the program below it)."""
    return [p for p in psutil.Process().children() if p.name() == "bwrap"]


@pytest.fixture
def no_waiting_sandboxes():
    """None of this process's pools hold sandboxes (earlier tests' tools keep some ready)."""
    close_all()
    yield
    close_all()


def test_sandboxes_started_ahead_run_one_program_each_and_end_with_the_pool(
    no_waiting_sandboxes,
):
    first = run_python("open('left.txt', 'w').write('x')\nprint('wrote')", LIMITS, ready=2)
    second = run_python("import os\nprint(os.listdir('.'))", LIMITS, ready=2)
    assert first.stdout == "wrote\n" and second.stdout == "[]\n"  # nothing of one call in the next
    time.sleep(0.2)
    assert len(_sandboxes()) == 2  # the pool refilled, waiting for the next calls
    close_all()
    left = [p for p in psutil.Process().children(recursive=True) if p.name() == "bwrap"]
    assert _sandboxes() == [] and left == []


def test_a_cancelled_call_ends_its_sandbox_and_threads_may_run(no_waiting_sandboxes):
    python = python_tool(SandboxLimits(cpu_s=5, wall_s=60), ready=0)
    pool = ToolPool(max_concurrency=2, timeout_s=1.0)
    call = ToolCall("python", {"code": "import time\ntime.sleep(50)"})
    threads = ToolCall(
        "python",
        {
            "code": "import threading\nt = threading.Thread(target=print, args=('in a thread',))\n"
            "t.start(); t.join()"
        },
    )
    slow, threaded = asyncio.run(_both(pool, python, call, threads))
    pool.close()
    assert slow.error == "timeout", slow
    assert threaded.ok and threaded.content == "in a thread\n", threaded
    deadline = time.monotonic() + 10
    while _sandboxes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sandboxes() == []


async def _both(pool, tool, a, b):
    return await asyncio.gather(pool.call({"python": tool}, a), pool.call({"python": tool}, b))


def test_the_working_folder_is_bounded_and_in_memory():
    small = SandboxLimits(cpu_s=5, wall_s=60, work_bytes=1 << 20)
    result = run_python(
        "import os\nprint(os.getcwd())\nopen('big', 'wb').write(b'x' * (4 << 20))", small
    )
    assert result.stdout == "/sandbox\n" and "No space left" in result.stderr, result


def test_installed_packages_are_shown_read_only_when_asked():
    code = UNHOOK + "import numpy\nprint(numpy.arange(4).sum())\nopen(numpy.__file__, 'a')"
    limits = SandboxLimits(cpu_s=10, wall_s=60, memory_bytes=1 << 30)
    shown = run_python(code, limits, packages=True)
    assert shown.stdout == "6\n" and "Read-only file system" in shown.stderr, shown
    hidden = run_python("import numpy", limits)
    assert "No module named 'numpy'" in hidden.stderr, hidden
