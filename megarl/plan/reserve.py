"""Device memory outside what the memory plan's items hold, per GPU, computed from the layout:
the CUDA context, the NCCL communicators the layout creates, and a fragmentation margin.

- CUDA context (:data:`CUDA_CONTEXT`): the driver's context, the loaded kernels and cuBLAS /
  cuDNN workspaces, none of it in torch's caching allocator. Measured on one H200 (driver
  580.159.04, CUDA 13.0, torch 2.11): 3.58-3.90 GiB outside torch's allocator before any
  communicator (``scripts/gpu_check.sh`` section 6); the plan takes the largest.
- NCCL: a communicator is made for each process group at its first collective (torch's
  ProcessGroupNCCL without ``device_id``), batched point-to-point included (it runs on its
  group's communicator); a group of one rank exchanges nothing. The first costs
  :data:`NCCL_FIRST` (measured on that H200: 0.38 GiB for one communicator, NCCL's one-time setup
  included); each one over several ranks adds its channel buffers, :data:`NCCL_PEER_BUFFERS` (read
  from NCCL's defaults: per channel and connected peer, 4 MiB for the Simple protocol, about
  4.6 MiB for LL128 and 0.25 MiB for LL, on up to 32 channels over NVLink). NVLink SHARP
  buffers (NCCL_NVLS_ENABLE on NVSwitch systems) are not counted.
- Fragmentation (:data:`FRAGMENTATION_SHARE` of the GPU): torch's caching allocator holds more
  than its tensors. Measured at a training step's peak on that H200: 0.06 GiB (0.5%); the margin
  is 2% because a colocated step also alternates training with vLLM's pools, which that step did
  not exercise.

Which groups make communicators (megatron-core 0.16.1's ``initialize_model_parallel``, vLLM
0.32's ``initialize_model_parallel``, megarl's own): :func:`communicators`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.parallel import ParallelLayout
from megarl.plan.units import GIB, fmt_gib

CUDA_CONTEXT = int(3.90 * GIB)  # measured, H200, torch 2.11 / CUDA 13 (see the module doc)
NCCL_FIRST = int(0.38 * GIB)  # measured, H200: one communicator, NCCL's setup included
NCCL_PEER_BUFFERS = GIB // 2  # read: channel buffers of a communicator over several ranks
FRAGMENTATION_SHARE = 0.02


@dataclass(frozen=True)
class Communicator:
    """A process group whose collectives make an NCCL communicator on every member."""

    name: str
    ranks: int


def communicators(
    layout: ParallelLayout, moe: bool, tied_embeddings: bool, rollout: bool
) -> list[Communicator]:
    """The NCCL communicators one rank of ``layout`` takes part in (groups of several ranks
    that issue collectives), in a run with the colocated vLLM rollout when ``rollout``."""
    tp, pp, dp, ep = layout.tp, layout.pp, layout.dp, layout.ep
    world = layout.world_size
    groups = [
        Communicator("world (megarl's gathers, the reshard's batched sends)", world),
        Communicator("tensor parallel", tp),
        Communicator("pipeline parallel (batched p2p)", pp),
        Communicator("data parallel (grad reduce-scatter, param all-gather)", dp),
        # megatron's INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP: the grad norm's all-reduce
        Communicator("distributed optimizer (grad norm)", tp * pp * dp),
    ]
    if tied_embeddings:
        groups.append(Communicator("tied embedding (first and last stage)", 2 if pp > 1 else 1))
    if moe:
        groups += [
            Communicator("expert parallel (token all-to-all)", ep),
            Communicator("expert tensor parallel (token all-gather)", tp),
            Communicator("expert data parallel (expert grads)", dp // ep),
            Communicator("expert tensor x expert x pipeline (expert grad norm)", tp * ep * pp),
        ]
    if rollout:
        groups.append(Communicator("vLLM tensor parallel", layout.rollout_tp))
        if moe:  # vLLM 0.32 makes its expert group for an MoE model, over its TP ranks
            groups.append(Communicator("vLLM expert parallel", layout.rollout_tp))
    return [g for g in groups if g.ranks > 1]


@dataclass(frozen=True)
class Reserve:
    """The reserve per GPU, item by item."""

    items: tuple[tuple[str, int], ...]
    groups: tuple[Communicator, ...] = ()

    @property
    def total(self) -> int:
        return sum(v for _, v in self.items)

    def lines(self) -> list[str]:
        """One line per item, for the preflight's report."""
        out = [f"reserve per GPU: {fmt_gib(self.total)} GiB, beside the items above"]
        width = max(len(name) for name, _ in self.items)
        out += [f"  {name:<{width}}  {fmt_gib(v):>5} GiB" for name, v in self.items]
        if self.groups:
            names = ", ".join(f"{g.name} [{g.ranks}]" for g in self.groups)
            out.append(f"  communicators: {names}")
        return out


def layout_reserve(
    layout: ParallelLayout,
    gpu_memory: int,
    moe: bool = False,
    tied_embeddings: bool = False,
    rollout: bool = True,
) -> Reserve:
    """The reserve of one GPU of ``layout`` (module doc)."""
    groups = communicators(layout, moe, tied_embeddings, rollout)
    nccl = NCCL_FIRST + NCCL_PEER_BUFFERS * len(groups) if groups else 0
    return Reserve(
        (
            ("CUDA context, cuBLAS/cuDNN workspaces (measured)", CUDA_CONTEXT),
            (f"NCCL: {len(groups)} communicators over several ranks", nccl),
            (
                f"fragmentation ({FRAGMENTATION_SHARE:.0%} of the GPU)",
                int(FRAGMENTATION_SHARE * gpu_memory),
            ),
        ),
        tuple(groups),
    )


def fixed_reserve(total: int) -> Reserve:
    """A reserve given as one figure (``--reserve``), not computed."""
    return Reserve((("given (--reserve)", total),))


__all__ = [
    "CUDA_CONTEXT",
    "FRAGMENTATION_SHARE",
    "NCCL_FIRST",
    "NCCL_PEER_BUFFERS",
    "Communicator",
    "Reserve",
    "communicators",
    "fixed_reserve",
    "layout_reserve",
]
