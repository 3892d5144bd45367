"""Where a training step's matmul time goes: every ``aten::mm`` / ``addmm`` of one step, timed one
by one and grouped by shape, with each group's GFLOP/s, and the memory the step faulted in.

A profiler's per-op table of one step is a poor guide on this machine: a matmul whose output lands
in memory just returned by the allocator pays the kernel's page faults inside the op, and one step
is one sample of a noisy shared CPU. Here each matmul is timed with ``perf_counter`` around the
call itself (a ``TorchDispatchMode``), the minor page faults inside it are counted, and the
whole-step faults are counted on a separate, untimed step, so the table says whether a slow group
is slow in its kernel or in first-touch memory.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_PAGE_MIB = resource.getpagesize() / 2**20


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _layout(t: torch.Tensor) -> str:
    """'N' for a row-major operand, 'T' for a transposed view of one, '?' otherwise."""
    if t.is_contiguous():
        return "N"
    if t.dim() == 2 and t.t().is_contiguous():
        return "T"
    return "?"


@dataclass
class MatmulGroup:
    shape: str  # "[m, k] x [k, n] NT": the operands' shapes and layouts
    calls: int = 0
    seconds: float = 0.0
    flops: float = 0.0
    faulted_mib: float = 0.0

    @property
    def gflops(self) -> float:
        return self.flops / self.seconds / 1e9 if self.seconds else 0.0


class _MatmulTimer(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[str, MatmulGroup] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.mm.default:
            a, b = args[0], args[1]
        elif func is torch.ops.aten.addmm.default:
            a, b = args[1], args[2]
        else:
            return func(*args, **kwargs)
        faults, start = _minor_faults(), time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        m, k = a.shape
        n = b.shape[1]
        key = f"[{m}, {k}] x [{k}, {n}] {_layout(a)}{_layout(b)}"
        group = self.groups.setdefault(key, MatmulGroup(key))
        group.calls += 1
        group.seconds += seconds
        group.flops += 2.0 * m * n * k
        group.faulted_mib += (_minor_faults() - faults) * _PAGE_MIB
        return out


def matmul_census(step: Callable[[], None]) -> tuple[list[MatmulGroup], float]:
    """One step under the matmul timer (groups, slowest total first) and the MiB of memory an
    ordinary step of it faults in (a second step, untimed)."""
    timer = _MatmulTimer()
    with timer:
        step()
    faults = _minor_faults()
    step()
    faulted_mib = (_minor_faults() - faults) * _PAGE_MIB
    return sorted(timer.groups.values(), key=lambda g: -g.seconds), faulted_mib


def print_census(name: str, groups: list[MatmulGroup], faulted_mib: float, top: int) -> None:
    total = sum(g.seconds for g in groups)
    flops = sum(g.flops for g in groups)
    print(
        f"\nmatmuls of one {name} step: {total:.2f} s, {flops / total / 1e9:.0f} GFLOP/s overall; "
        f"a step faults in {faulted_mib:.0f} MiB"
    )
    for g in groups[:top]:
        print(
            f"  {g.shape:34s} x{g.calls:<4d} {g.seconds * 1e3:8.1f} ms  {g.gflops:6.1f} GFLOP/s"
            f"  faults {g.faulted_mib:6.1f} MiB"
        )


def census_record(groups: list[MatmulGroup], faulted_mib: float) -> dict[str, object]:
    """What the results file keeps of a census."""
    total = sum(g.seconds for g in groups)
    return {
        "matmul_s": total,
        "matmul_gflops": sum(g.flops for g in groups) / total / 1e9 if total else 0.0,
        "step_faulted_mib": faulted_mib,
        "groups": [
            {"shape": g.shape, "calls": g.calls, "seconds": g.seconds, "gflops": g.gflops}
            for g in groups
        ],
    }
