"""The ranks' environment from the launcher: CPU ranks on Linux get glibc's keep-freed-memory
settings unless the user set them; CUDA ranks and other systems get none; and a process started
with them really runs under them (glibc reads them at start)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megarl.host_allocator import CPU_ALLOCATOR_ENV, cpu_allocator_env
from megarl.rank_process_env import launch_env

pytestmark = pytest.mark.unit


def test_cpu_ranks_get_the_allocator_settings_unless_set():
    assert cpu_allocator_env(cuda=False, platform="linux") == CPU_ALLOCATOR_ENV
    assert cpu_allocator_env(cuda=True, platform="linux") == {}
    assert cpu_allocator_env(cuda=False, platform="darwin") == {}
    env = launch_env({"PATH": "/bin"}, nproc=2, cuda=False, threads_per_rank=3)
    if sys.platform.startswith("linux"):
        assert env["MALLOC_MMAP_MAX_"] == "0" and int(env["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 32
    assert env["OMP_NUM_THREADS"] == "3" and env["PATH"] == "/bin"
    # the user's own values win, for threads as for the allocator
    mine = {"MALLOC_MMAP_MAX_": "65536", "OMP_NUM_THREADS": "1"}
    env = launch_env(mine, nproc=2, cuda=False, threads_per_rank=3)
    assert env["MALLOC_MMAP_MAX_"] == "65536" and env["OMP_NUM_THREADS"] == "1"
    env = launch_env({}, nproc=1, cuda=True, env_extra={"X": "1"})
    assert "MALLOC_MMAP_MAX_" not in env and env["X"] == "1" and env["OMP_NUM_THREADS"] == "4"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's settings")
def test_a_process_started_with_them_keeps_large_blocks_off_mmap():
    """Allocate and free a 64 MiB buffer 20 times: with glibc's defaults each one is a fresh
    mapping that faults its pages in again; under the settings the heap keeps the block and the
    repeats fault (almost) nothing."""
    probe = (
        "import resource\n"
        "def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "b = bytearray(64 << 20); del b\n"
        "start = faults()\n"
        "for _ in range(20):\n"
        "    b = bytearray(64 << 20); del b\n"
        "print(faults() - start)\n"
    )

    def repeat_faults(extra: dict[str, str]) -> int:
        env = {"PATH": os.environ.get("PATH", ""), **extra}  # glibc's defaults unless extra
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    default, kept = repeat_faults({}), repeat_faults(dict(CPU_ALLOCATOR_ENV))
    # every repeat faults its buffer in again (one fault per page, or per huge page under THP)
    assert default >= 20, default
    assert kept < default / 10, (kept, default)
