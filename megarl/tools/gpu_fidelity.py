"""The GPU check's section 6: what megatron, CUDA and PyTorch really allocate, beside what megarl's
memory plan assumes. Each figure settles something that reading the CUDA code could not:

- optimizer offload (``actor.optimizer_offload=1``): device bytes per parameter it frees, against
  the plan's fp32 main weight + Adam's two moments (12 bytes, with megatron's precision-aware
  optimizer, which megarl turns on with the offload and which needs Transformer Engine; 8 without
  it, the path measured where TE is missing: megatron then keeps the main weights on the device);
- the rollout's grad-buffer release (:class:`megarl.trainer.rollout_offload.ActorMemory`): the
  bytes it frees, and how much of it returns to the device once the cache is emptied;
- overlapped gradient reduction at one rank: grads and updated weights bit-identical to the
  plain reduction (deterministic kernels, with a plain run repeated as the control);
- pinned host memory: what torch's caching host allocator really takes for a request (it rounds
  blocks up to a power of two);
- the reserve: device memory outside torch's allocator (CUDA context, cuBLAS/cuDNN workspaces)
  and what one NCCL communicator adds, beside the reserve plan's figures for them
  (:mod:`megarl.plan.reserve`), and the allocator's slack (reserved - allocated) at a training
  step's peak.

On the CPU only the grad-buffer release runs (the rest needs CUDA); its rows say so.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace
from importlib.util import find_spec
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl import platform
from megarl.models.distributed import OptimSettings
from megarl.parallel import destroy_model_parallel
from megarl.plan.memory import GPU_BF16, offload_freed_bytes_per_param
from megarl.plan.reserve import CUDA_CONTEXT, NCCL_FIRST
from megarl.trainer.rollout_offload import ActorMemory

if TYPE_CHECKING:
    from megarl.tools.gpu_report import Report
    from megarl.tools.gpu_trainable import Trainable

SECTION = "6 fidelity"
GIB = 2**30


def _free_device_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _parameters(model: Trainable) -> int:
    return sum(p.numel() for p in model.ddp.parameters())


def _stepped(
    build: Callable[[OptimSettings], Trainable], settings: OptimSettings, steps: int = 2
) -> Trainable:
    model = build(settings)
    for _ in range(steps):  # Adam's moments exist after the first
        model.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return model


def optimizer_offload_bytes(report: Report, build: Callable[[OptimSettings], Trainable]) -> None:
    """Device bytes per parameter that ``optimizer_offload=1`` frees after two steps."""
    held = {}
    params = 0
    # megarl offloads through megatron's precision-aware optimizer, which megatron-core 0.16.1
    # checks against Transformer Engine: without TE the row measures the offload without it
    te = find_spec("transformer_engine") is not None
    for share in (0.0, 1.0):
        _free_device_cache()
        base = torch.cuda.memory_allocated()
        settings = OptimSettings(lr=1e-5, optimizer_offload=share, precision_aware_offload=te)
        model = _stepped(build, settings)
        held[share] = torch.cuda.memory_allocated() - base
        params = _parameters(model)
        del model
        destroy_model_parallel()
    per_param = (held[0.0] - held[1.0]) / max(params, 1)
    planned = offload_freed_bytes_per_param(replace(GPU_BF16, offload_main_params=te))
    path = "precision-aware" if te else "without precision-aware optimizer (no TE)"
    report.add(
        SECTION,
        f"optimizer offload, {path}: device bytes freed per parameter (measured / planned)",
        f"{per_param:.2f} / {planned}",
    )


def grad_buffer_release(report: Report, build: Callable[[OptimSettings], Trainable]) -> None:
    """The rollout's release of the actor's grad buffers: bytes freed, returned to the device."""
    cuda = torch.cuda.is_available()
    _free_device_cache()
    model = _stepped(build, OptimSettings(lr=1e-5), steps=1)
    memory = ActorMemory(model.ddp, model.optimizer, move_optimizer=False)
    buffers = sum(b.grad_data.numel() * b.grad_data.element_size() for b in model.ddp.buffers)
    allocated = torch.cuda.memory_allocated() if cuda else 0
    reserved = torch.cuda.memory_reserved() if cuda else 0
    freed = int(memory.release()["hybrid/grad_bytes_freed"])
    released = all(b.grad_data.untyped_storage().nbytes() == 0 for b in model.ddp.buffers)
    report.add(
        SECTION,
        "grad buffers released before the rollout (bytes freed / buffer bytes)",
        f"{freed / GIB:.3f} / {buffers / GIB:.3f} GiB",
        "equal, storages empty",
        freed == buffers and released,
    )
    if cuda:
        dropped = allocated - torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        returned = reserved - torch.cuda.memory_reserved()
        report.add(
            SECTION,
            "grad-buffer release: allocated drop / returned to the device after empty_cache",
            f"{dropped / GIB:.3f} / {returned / GIB:.3f} GiB",
            f">= 0.9 x {buffers / GIB:.3f} GiB each",
            dropped >= 0.9 * buffers and returned >= 0.9 * buffers,
        )
    else:
        report.add(SECTION, "grad-buffer release returned to the device", "CUDA only")
    memory.restore()
    zeroed = all(
        b.grad_data.untyped_storage().nbytes() > 0 and not b.grad_data.any()
        for b in model.ddp.buffers
    )
    model.step()
    finite = all(torch.isfinite(p).all() for p in model.ddp.parameters())
    report.add(
        SECTION,
        "grad buffers restored zeroed, next step finite",
        str(zeroed and finite),
        "True",
        zeroed and finite,
    )
    del model, memory
    destroy_model_parallel()


def _grads_and_weights(
    build: Callable[[OptimSettings], Trainable], overlap: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Main grads after one forward+backward and weights after the optimizer step, on the host."""
    _free_device_cache()
    model = build(OptimSettings(lr=1e-3, overlap_grad_reduce=overlap))
    model.forward_backward()
    grads = [p.main_grad.detach().cpu().clone() for p in model.ddp.parameters()]
    model.optimizer.step()
    weights = [p.detach().cpu().clone() for p in model.ddp.parameters()]
    del model
    destroy_model_parallel()
    return grads, weights


def _difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[int, float]:
    """(tensors that differ, largest |difference|)."""
    differ = [(x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True)]
    return sum(d > 0 for d in differ), max(differ, default=0.0)


def overlapped_reduce_identical(
    report: Report, build: Callable[[OptimSettings], Trainable]
) -> None:
    """One step with megatron's overlapped grad reduction vs the plain one, same weights and
    batch, one rank: every main grad and updated weight bit for bit. torch's deterministic
    algorithms are on and attention runs on SDPA's math backend (cuDNN's attention backward
    differs from run to run, by up to 1e-13 in one H200 run, even with deterministic algorithms
    requested); cuBLAS is deterministic with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which
    scripts/gpu_check.sh sets. A second plain run is the control: when it differs from the
    first, run-to-run differences remain and the row decides nothing (info)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            plain = _grads_and_weights(build, overlap=False)
            again = _grads_and_weights(build, overlap=False)
            overlapped = _grads_and_weights(build, overlap=True)
    finally:
        torch.use_deterministic_algorithms(was)
    n = len(plain[0])
    differing = []
    for label, other in (("plain again (control)", again), ("overlapped", overlapped)):
        grads, weights = _difference(plain[0], other[0]), _difference(plain[1], other[1])
        differing.append(grads[0] + weights[0])
        report.add(
            SECTION,
            f"{label} vs plain grad reduce, one rank: grads / weights differing of {n}",
            f"{grads[0]} (max {grads[1]:.1e}) / {weights[0]} (max {weights[1]:.1e})",
        )
    control, over = differing
    if control:
        report.add(
            SECTION,
            "overlapped grad reduce bit-identical to plain",
            "undecided: the control differs from run to run",
        )
    else:
        report.add(
            SECTION,
            "overlapped grad reduce bit-identical to plain",
            str(over == 0),
            "True",
            over == 0,
        )


def pinned_rounding(report: Report) -> None:
    """Bytes torch's caching host allocator pins for a request, from its own statistics (the
    cache emptied first, so no cached block is reused)."""

    def pinned_bytes() -> int:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))

    figures = []
    for request in (int(1.5 * GIB) + 1, 3 * GIB + 1):
        torch._C._host_emptyCache()
        before = pinned_bytes()
        block = torch.empty(request, dtype=torch.uint8, device="cpu", pin_memory=True)
        taken = pinned_bytes() - before
        figures.append(f"{request / GIB:.2f} -> {taken / GIB:.2f} GiB ({taken / request:.2f}x)")
        del block
    torch._C._host_emptyCache()
    report.add(SECTION, "pinned host memory: requested -> pinned", "; ".join(figures))


def device_reserve(report: Report) -> None:
    """Device memory outside torch's allocator, and what one new NCCL communicator adds."""

    def outside_torch() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved()

    _free_device_cache()
    before = outside_torch()
    group = dist.new_group([dist.get_rank()])
    ones = torch.ones(1, device=platform.collective_device(group))
    dist.all_reduce(ones, group=group)
    after = outside_torch()
    dist.destroy_process_group(group)
    report.add(
        SECTION,
        "outside torch's allocator: CUDA context + libraries / + one NCCL communicator",
        f"{before / GIB:.2f} / {(after - before) / GIB:.2f} GiB",
        f"plan: {CUDA_CONTEXT / GIB:.2f} / {NCCL_FIRST / GIB:.2f} GiB (megarl/plan/reserve.py)",
    )


def allocator_slack(report: Report, build: Callable[[OptimSettings], Trainable]) -> None:
    """torch's caching allocator: reserved beyond allocated at a training step's peak."""
    _free_device_cache()
    torch.cuda.reset_peak_memory_stats()
    model = _stepped(build, OptimSettings(lr=1e-5))
    peak_allocated = torch.cuda.max_memory_allocated()
    peak_reserved = torch.cuda.max_memory_reserved()
    del model
    destroy_model_parallel()
    slack = peak_reserved - peak_allocated
    report.add(
        SECTION,
        "allocator slack at the step's peak (reserved - allocated)",
        f"{slack / GIB:.2f} GiB ({100 * slack / max(peak_allocated, 1):.1f}% of "
        f"{peak_allocated / GIB:.2f} GiB)",
    )


def run_fidelity(report: Report, build: Callable[[OptimSettings], Trainable]) -> None:
    """Every row of this section; each check that raises is one FAIL row of its own."""
    checks: list[tuple[str, Callable[[], None]]] = [
        ("grad-buffer release", lambda: grad_buffer_release(report, build))
    ]
    if torch.cuda.is_available():
        checks += [
            ("optimizer offload", lambda: optimizer_offload_bytes(report, build)),
            ("overlapped grad reduce", lambda: overlapped_reduce_identical(report, build)),
            ("pinned host memory", lambda: pinned_rounding(report)),
            ("reserve", lambda: device_reserve(report)),
            ("allocator slack", lambda: allocator_slack(report, build)),
        ]
    else:
        report.add(
            SECTION,
            "optimizer offload, overlapped reduce, pinned memory, reserve, slack",
            "CUDA only",
        )
    for name, check in checks:
        try:
            check()
        except Exception as e:  # one broken check must not hide the others' figures
            destroy_model_parallel()
            report.add(SECTION, f"{name}: raised", f"{type(e).__name__}: {str(e)[:120]}", "", False)
