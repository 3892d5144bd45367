"""``megarl plan``: which TP x PP x DP layouts (and rollout TP, recompute, offload) fit a model on
a cluster, what each GPU holds, and a predicted step time to rank them.

Pure Python (no torch): importable anywhere, fast. :mod:`megarl.plan.measure` (torch) measures
the real footprint the memory model is checked against.
"""

from megarl.plan.hardware import Cluster
from megarl.plan.known_models import KNOWN_MODELS, resolve_model
from megarl.plan.memory import (
    CPU_FP32,
    GPU_BF16,
    MemoryEstimate,
    Numerics,
    Options,
    estimate_memory,
)
from megarl.plan.report import format_json, format_text, to_json
from megarl.plan.search import Filters, PlanResult, search
from megarl.plan.units import parse_bytes
from megarl.plan.workload import Workload

__all__ = [
    "CPU_FP32",
    "GPU_BF16",
    "KNOWN_MODELS",
    "Cluster",
    "Filters",
    "MemoryEstimate",
    "Numerics",
    "Options",
    "PlanResult",
    "Workload",
    "estimate_memory",
    "format_json",
    "format_text",
    "parse_bytes",
    "resolve_model",
    "search",
    "to_json",
]
