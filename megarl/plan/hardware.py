"""The machine a plan is for: GPU count and memory, node size, and the speeds the cost model uses.

Defaults are H100 SXM class numbers: 989 dense bf16 TFLOPS, 3.35 TB/s HBM, 450 GB/s NVLink per
direction inside a node, 50 GB/s (400 Gb/s) network per GPU between nodes, 25 GB/s host link.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.errors import ConfigError
from megarl.plan.units import GIB


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    gpu_memory: int = 80 * GIB
    # per GPU: CUDA context, NCCL buffers, allocator fragmentation; None: computed from each
    # layout (megarl.plan.reserve)
    reserve: int | None = None
    peak_tflops: float = 989.0
    mfu: float = 0.4  # share of peak that training matmuls reach
    hbm_gbps: float = 3350.0
    nvlink_gbps: float = 450.0
    network_gbps: float = 50.0
    host_gbps: float = 25.0
    nvlink_domain: int | None = None  # GPUs sharing NVLink (None: a node)

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be a positive integer, got {value!r}"
                )
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            nodes = self.gpus // self.gpus_per_node
            raise ConfigError(
                f"--gpus {self.gpus} is not a whole number of {self.gpus_per_node}-GPU nodes; use "
                f"--gpus {nodes * self.gpus_per_node} or {(nodes + 1) * self.gpus_per_node}, or set "
                f"--gpus-per-node to the real node size"
            )
        if self.reserve is not None and self.reserve >= self.gpu_memory:
            raise ConfigError(
                f"--reserve ({self.reserve / GIB:.1f} GiB) must be smaller than --gpu-memory "
                f"({self.gpu_memory / GIB:.1f} GiB)"
            )
        if not 0.0 < self.mfu <= 1.0:
            raise ConfigError(f"--mfu {self.mfu} must be a fraction in (0, 1]")

    @property
    def node_size(self) -> int:
        """GPUs per node actually used (a job smaller than a node uses part of one)."""
        return min(self.gpus, self.gpus_per_node)

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def nvlink_size(self) -> int:
        return min(self.nvlink_domain or self.gpus_per_node, self.node_size)

    def tp_choices(self) -> list[int]:
        """TP sizes that stay inside a node and divide the GPU count."""
        return [t for t in divisors(self.node_size) if self.gpus % t == 0]

    def link_gbps(self, span: int) -> float:
        """Bandwidth of a group of ``span`` consecutive ranks: NVLink inside a domain, else the
        network."""
        return self.nvlink_gbps if span <= self.nvlink_size else self.network_gbps
