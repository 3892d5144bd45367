"""Every tensor megarl creates for a model or a collective names its device at the source.

On a CPU-only machine a tensor created without ``device=`` lands where the model is (the CPU), so
no run here can see it; on a GPU it lands on the CPU beside CUDA weights (an error in the model)
or goes to NCCL (which takes CUDA tensors only). This lint reads megarl/ and checkpoints_tools/
and fails on:

1. a call of a torch tensor factory (``torch.tensor``, ``zeros``, ``arange`` ...) without a
   ``device=`` argument (or with ``device=None``), outside :data:`CPU_BY_DESIGN` (functions whose
   tensors stay on the host on purpose, each with its reason); and a factory imported by its bare
   name (``from torch import zeros``), which would hide its calls from this lint;
2. a collective call (``dist.all_reduce``, ``broadcast`` ...) at a site not in
   :data:`COLLECTIVE_SITES`, each listed with where its tensor comes from; a new site fails
   until someone has checked its tensor is made on the backend's device and listed it.

What it cannot catch: a tensor made on the wrong device *explicitly* (``device="cpu"`` where the
model's device was meant), a host tensor coming from a library (tokenizer, numpy) and meeting a
CUDA one, or a collective whose tensor was made correctly but moved. Those show only on a GPU
(``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megarl.platform_sites import dotted_name  # "torch.cuda.foo" from an attribute chain

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("megarl", "checkpoints_tools")

FACTORIES = frozenset(
    {
        "tensor",
        "as_tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "rand",
        "randn",
        "randint",
        "randperm",
        "linspace",
        "logspace",
        "eye",
        "empty_strided",
    }
)
COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "reduce",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "all_to_all",
        "all_to_all_single",
    }
)

# (file, function qualname) -> why its factory calls may leave the device to the default (CPU).
CPU_BY_DESIGN: dict[tuple[str, str], str] = {
    ("megarl/checkpoint/reader.py", "DistCheckpointReader.read"): (
        "checkpoint tensors are read into host memory for conversion, never into a model"
    ),
    ("checkpoints_tools/safetensors_writer.py", "nbytes"): (
        "a 0-d tensor only to learn a dtype's element size"
    ),
    ("megarl/algos/settings.py", "try_on_tiny_batch"): (
        "the pre-launch config check calls the chosen loss and estimator on a tiny host batch"
    ),
    ("megarl/algos/choices.py", "_try_correction"): (
        "the pre-launch config check calls the chosen rollout correction on a tiny host batch"
    ),
    ("megarl/world_split.py", "Bridge.broadcast_object"): (
        "objects cross the worlds pickled over gloo bridges (host tensors); NCCL bridges carry "
        "only the weights"
    ),
    ("megarl/algos/dpo.py", "try_dpo_loss"): (
        "the pre-launch config check calls the chosen DPO loss on two made-up host pairs"
    ),
    ("megarl/tools/testing/assets.py", "randomize_"): (
        "fills CPU-built Hugging Face test models before they are saved to disk"
    ),
    ("megarl/weights/hf_saved_names.py", "saved_tensor_index"): (
        "a host index probe through transformers' save conversion; the positions it yields are "
        "moved to the parameter's device"
    ),
}

# file -> {function qualname: where the tensor of its collective comes from}
COLLECTIVE_SITES: dict[str, dict[str, str]] = {
    "megarl/trainer/routing_metrics.py": {
        "routing_metrics": "three counts made on platform.collective_device()",
    },
    "megarl/trainer/routing_flags.py": {
        "combine_over_model_parallel": "routing_flags.flags_buffer made on "
        "platform.collective_device()",
    },
    "megarl/tools/gpu_fidelity.py": {
        "device_reserve": "one element made on platform.collective_device(group)",
    },
    "megarl/weights/execute.py": {
        "ReshardExecutor._post": "model parameter views and buckets made on the parameters' device",
    },
    "megarl/rollout/hf_rollout.py": {
        "_gather_group": "the bucket's slices (on the actor's device) into a buffer made on "
        "platform.collective_device()",
    },
    "megarl/rollout/mismatch.py": {
        "logprob_mismatch": "sums/peak made on platform.collective_device()",
    },
    "megarl/metrics.py": {
        "reduce_metrics": "values made on platform.collective_device()",
    },
    "megarl/trainer/reward_failures.py": {
        "stop_on_failed_scores": "counts made on platform.collective_device()",
    },
    "megarl/trainer/dp_collectives.py": {
        "dp_sum": "copied to platform.collective_device()",
    },
    "megarl/run/finite.py": {
        "all_finite": "flag made on platform.collective_device()",
    },
    "megarl/trainer/model_ops.py": {
        "rollout_is_finite": "flag made on platform.collective_device()",
    },
    "megarl/run/checkpointing.py": {
        "_agree_on_failure": "flag made on platform.collective_device()",
    },
    "megarl/run/preemption.py": {
        "Preemption.requested": "flag made on platform.collective_device()",
    },
    "megarl/models/lora_peft.py": {
        "_gather": "LoRA adapter parameter shards (or their main_grad), on the model's device",
    },
    "megarl/models/export.py": {
        "gather_group": "shards are empty_like the model parameter (or a stack of its shards)",
    },
    "megarl/trainer/ep_micro_batches.py": {
        "_dp_max": "made on platform.collective_device()",
    },
    "megarl/platform.py": {
        "_adapt_moe.gather_first_dim": "pieces made on the device of megatron's token tensor",
    },
    "megarl/models/forward.py": {
        "broadcast_from_last_stage": "callers pass tensors made on the model's device",
    },
    "megarl/algos/vocab_parallel.py": {
        "_all_reduce": "reductions of the logits shard (on the model's device)",
    },
    "megarl/trainer/group_weights.py": {
        "GroupWeights._agree": "made on platform.collective_device()",
    },
    "megarl/run/evaluation.py": {
        "dataset_totals": "totals made on platform.collective_device()",
    },
}


class _Finder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.stack: list[str] = []
        self.factories: list[tuple[str, int, str]] = []  # (qualname, line, call)
        self.collectives: list[tuple[str, int, str]] = []
        self.bare_imports: list[tuple[int, str]] = []

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module == "torch":
            self.bare_imports += [(node.lineno, a.name) for a in node.names if a.name in FACTORIES]

    def _scoped(self, node) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        name = dotted_name(node.func)
        where = ".".join(self.stack) or "<module>"
        head, _, leaf = name.rpartition(".")
        device = next((kw.value for kw in node.keywords if kw.arg == "device"), None)
        no_device = device is None or (isinstance(device, ast.Constant) and device.value is None)
        if head == "torch" and leaf in FACTORIES and no_device:
            self.factories.append((where, node.lineno, name))
        if head in ("dist", "torch.distributed") and leaf in COLLECTIVES:
            self.collectives.append((where, node.lineno, name))
        self.generic_visit(node)


def _scan() -> dict[str, _Finder]:
    out = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            finder = _Finder()
            finder.visit(ast.parse(path.read_text(), filename=str(path)))
            out[path.relative_to(ROOT).as_posix()] = finder
    return out


@pytest.fixture(scope="module")
def scan() -> dict[str, _Finder]:
    return _scan()


def test_every_tensor_factory_names_its_device(scan: dict[str, _Finder]) -> None:
    bad = [
        f"{file}:{line} {call}(...) in {where}"
        for file, finder in scan.items()
        for where, line, call in finder.factories
        if (file, where) not in CPU_BY_DESIGN
    ]
    assert not bad, (
        "tensor factories without device= (create the tensor on platform.device() or on the "
        "device of the tensor it meets; list host-only code in CPU_BY_DESIGN with a reason):\n"
        + "\n".join(bad)
    )


def test_no_factory_is_imported_by_its_bare_name(scan: dict[str, _Finder]) -> None:
    bad = [
        f"{file}:{line} from torch import {name}"
        for file, f in scan.items()
        for line, name in f.bare_imports
    ]
    assert not bad, f"call torch factories as torch.NAME(..., device=...): {bad}"


def test_cpu_by_design_entries_still_exist(scan: dict[str, _Finder]) -> None:
    present = {(file, where) for file, f in scan.items() for where, _, _ in f.factories}
    stale = sorted(set(CPU_BY_DESIGN) - present)
    assert not stale, f"CPU_BY_DESIGN lists functions without device-less factories: {stale}"


def test_every_collective_site_is_reviewed(scan: dict[str, _Finder]) -> None:
    found = {(file, where) for file, finder in scan.items() for where, _, _ in finder.collectives}
    listed = {(file, where) for file, sites in COLLECTIVE_SITES.items() for where in sites}
    new = sorted(found - listed)
    gone = sorted(listed - found)
    assert not new, (
        "collective calls at unreviewed sites: make their tensors on "
        "platform.collective_device() (NCCL: CUDA, gloo: CPU), then list them in "
        f"COLLECTIVE_SITES: {new}"
    )
    assert not gone, f"COLLECTIVE_SITES lists sites that no longer exist: {gone}"


def test_the_lint_sees_a_missing_device() -> None:
    """The finder itself: a device-less factory and a collective are reported, a device= is not."""
    finder = _Finder()
    finder.visit(
        ast.parse(
            "import torch\nimport torch.distributed as dist\n"
            "def f(x):\n"
            "    a = torch.zeros(3)\n"
            "    b = torch.tensor([1], device=x.device)\n"
            "    dist.all_reduce(a)\n"
            "    c = torch.ones(2, device=None)\n"
            "from torch import empty\n"
        )
    )
    assert finder.factories == [("f", 4, "torch.zeros"), ("f", 7, "torch.ones")]
    assert finder.bare_imports == [(8, "empty")]
    assert finder.collectives == [("f", 6, "dist.all_reduce")]
