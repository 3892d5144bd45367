"""Device and backend choice, and the ONE place that adapts megatron-core to a CPU-only torch.

megatron-core 0.16 calls CUDA-only torch APIs in five groups:
  1. ``torch.cuda.current_device()`` used as a device, ``torch.cuda.synchronize()``;
  2. the model-parallel RNG tracker built on the CUDA generator;
  3. hard-coded ``device="cuda"`` / ``.cuda()``;
  4. ``tensor.type() == 'torch.cuda.FloatTensor'`` checks in the optimizer and grad clipping;
  5. CUDA streams and events in DDP's grad sync.

Without CUDA, :func:`adapt_megatron_for_cpu` fixes them from the outside, without editing
site-packages, and only inside megatron: each module listed in :data:`ADAPTED_MODULES` gets a
private view of ``torch`` (:class:`_CpuTorch`) whose ``torch.cuda`` answers for the CPU and whose
tensor factories map ``device="cuda"`` to the CPU; the few functions that call CUDA-only tensor methods are
wrapped (:data:`TENSOR_METHOD_FUNCTIONS`). vLLM, transformers and user code keep the real torch
(a global patch slowed vLLM's CPU decode by 15-20%).

``tests/unit/test_platform.py`` pins every CUDA-only call site of the megatron modules megarl
loads, so an upgrade that moves one fails by name. All adaptations: :mod:`megarl.adaptations`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    import numpy as np
    from torch.distributed import ProcessGroup

# what torch takes as a device argument
DeviceLike: TypeAlias = torch.device | str | int

# Modules whose `torch` global is replaced by the CPU view.
ADAPTED_MODULES: tuple[str, ...] = (
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    # mixture of experts (Qwen3-MoE, Mixtral): router, all-to-all dispatcher, their helpers
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
)

# (module, attribute path) of functions that call CUDA-only *tensor methods*: they compare
# `tensor.type()` with CUDA type names, or move tensors with `.cuda()`. They run inside
# :func:`_cpu_tensor_methods`.
TENSOR_METHOD_FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    (
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer._build_model_and_main_param_groups",
    ),
    # layout-independent optimizer checkpoints (``fully_reshardable``) gather through it
    (
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer.get_parameter_state_dp_zero",
    ),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    (
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule.setup_embeddings_and_output_layer",
    ),
)

_CPU = torch.device("cpu")
_applied = False

# megatron-core announces its CPU fallbacks at import; they are expected here, not news.
for _message in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
):
    warnings.filterwarnings("ignore", message=f".*{_message}.*")


def device() -> torch.device:
    """The one device this process computes on: ``cuda:LOCAL_RANK`` where CUDA is present (the
    launcher's local rank; the current CUDA device outside a launcher), else the CPU.

    Every tensor megarl makes for a model or a collective is created on it (or on the tensor it
    combines with); ``tests/unit/test_device_discipline.py`` holds the code to that.
    """
    if torch.cuda.is_available():
        local = os.environ.get("LOCAL_RANK")
        return torch.device(
            "cuda", int(local) if local is not None else torch.cuda.current_device()
        )
    return _CPU


def collective_device(group: ProcessGroup | None = None) -> torch.device:
    """The device a collective's tensors must be on: CUDA for NCCL, the CPU for gloo."""

    backend = dist.get_backend(group) if dist.is_initialized() else distributed_backend()
    return device() if str(backend) == "nccl" else _CPU


def distributed_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _cpu_device(value: object) -> object:
    if isinstance(value, str) and value.startswith("cuda"):
        return _CPU
    if isinstance(value, torch.device) and value.type == "cuda":
        return _CPU
    return value


class _Dummy:
    """A stand-in for CUDA streams, events and stream contexts: every call does nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Dummy:
        return self

    def __getattr__(self, name: str) -> _Dummy:
        return _Dummy()

    def __enter__(self) -> _Dummy:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _CpuCuda(types.SimpleNamespace):
    """What megatron sees as ``torch.cuda`` on a CPU-only machine."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cuda, name)


def _make_cpu_cuda() -> _CpuCuda:
    def set_rng_state(state: torch.Tensor, device: DeviceLike | None = None) -> None:
        torch.set_rng_state(state)

    def get_rng_state(device: DeviceLike | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    rng = types.SimpleNamespace(get_rng_state=get_rng_state, set_rng_state=set_rng_state)
    return _CpuCuda(
        # group 1
        current_device=lambda: _CPU,
        synchronize=lambda *a, **k: None,
        set_device=lambda *a, **k: None,
        device_count=lambda: 0,
        is_available=lambda: False,
        empty_cache=lambda: None,
        # group 2
        manual_seed=torch.manual_seed,
        get_rng_state=get_rng_state,
        set_rng_state=set_rng_state,
        default_generators=(torch.default_generator,),
        random=rng,
        # group 5
        Stream=_Dummy,
        Event=_Dummy,
        stream=_Dummy(),
        current_stream=_Dummy(),
        default_stream=_Dummy(),
        nvtx=_Dummy(),
    )


_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "triu",
    "tril",
)


class _CpuTorch(types.ModuleType):
    """The ``torch`` module as the adapted megatron modules see it (forwarding the rest)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _make_cpu_cuda()
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(fn)
        def wrapper(*args: object, **kwargs: object) -> torch.Tensor:
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return wrapper

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


_CUDA_TYPES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cpu_tensor_methods() -> Iterator[None]:
    """Within the block, ``tensor.type()`` of CPU float tensors reports the CUDA type name and
    ``tensor.cuda()`` leaves a CPU tensor where it is."""
    original_type, original_cuda = torch.Tensor.type, torch.Tensor.cuda

    def type_(self: torch.Tensor, *args: object, **kwargs: object) -> str | torch.Tensor:
        result = original_type(self, *args, **kwargs)
        if not args and not kwargs:
            return _CUDA_TYPES.get(result, result)
        return result

    def cuda_(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self

    torch.Tensor.type = type_
    torch.Tensor.cuda = cuda_
    try:
        yield
    finally:
        torch.Tensor.type = original_type
        torch.Tensor.cuda = original_cuda


def _resolve(module: types.ModuleType, path: str) -> tuple[object, str, Any]:
    owner: object = module
    *parents, leaf = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, leaf, owner.__dict__[leaf]


def _wrap_tensor_methods(module_name: str, path: str) -> None:
    module = importlib.import_module(module_name)
    owner, leaf, raw = _resolve(module, path)
    is_static = isinstance(raw, staticmethod)
    is_class = isinstance(raw, classmethod)
    fn = raw.__func__ if (is_static or is_class) else raw

    @functools.wraps(fn)
    def wrapped(*args: object, **kwargs: object) -> object:
        with _cpu_tensor_methods():
            return fn(*args, **kwargs)

    wrapped.__megarl_adapted__ = True  # type: ignore[attr-defined]
    if is_static:
        wrapped = staticmethod(wrapped)  # type: ignore[assignment]
    elif is_class:
        wrapped = classmethod(wrapped)  # type: ignore[assignment]
    setattr(owner, leaf, wrapped)
    if not isinstance(owner, type):
        # Modules that did `from ... import fn` hold the original: rebind them too.

        for mod in list(sys.modules.values()):
            if (
                getattr(mod, "__name__", "").startswith("megatron.")
                and getattr(mod, leaf, None) is fn
            ):
                setattr(mod, leaf, wrapped)


def _adapt_rng_tracker() -> None:
    """Group 2: megatron's RNG state helpers read the CUDA generator; use the CPU one."""
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(
        device: DeviceLike = "cuda", clone: bool = False, graph_safe: bool = False
    ) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


def _adapt_moe() -> None:
    """Mixture-of-experts paths on CPU/gloo, beyond the CPU view of torch:

    - ``moe_utils`` refers to Transformer Engine's ``te_general_gemm`` in the router's linear
      layer although it defines it only when TE imports: without TE it is None (the torch path).
    - ``maybe_move_tensor_to_cpu`` turns split sizes into numpy only for CUDA tensors; the
      all-to-all then gets CPU tensors as split sizes, which ``all_to_all_single`` refuses.
    - gloo's all-gather takes equal pieces only; the dispatcher gathers uneven token counts over
      the TP x EP group (TP>1 with EP>1): pad each piece to the largest, gather, strip.
    """

    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original_move = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(
        tensor: torch.Tensor, as_numpy: bool = False, record_stream: bool = False
    ) -> torch.Tensor | np.ndarray:
        tensor = original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    original_gather = mappings._gather_along_first_dim

    def gather_first_dim(
        input_: torch.Tensor,
        group: ProcessGroup,
        output_split_sizes: Sequence[int] | torch.Tensor | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        sizes = None if output_split_sizes is None else [int(n) for n in output_split_sizes]
        if sizes is None or len(set(sizes)) == 1 or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)

        padded = torch.zeros(
            (max(sizes), *input_.shape[1:]), dtype=input_.dtype, device=input_.device
        )
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes, strict=True)])

    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if not name.startswith("megatron."):
            continue
        # (a module's own names, rebound: ModuleType declares none of them)
        if getattr(module, "maybe_move_tensor_to_cpu", None) is original_move:
            module.maybe_move_tensor_to_cpu = move_to_cpu  # type: ignore[attr-defined]
        if getattr(module, "_gather_along_first_dim", None) is original_gather:
            module._gather_along_first_dim = gather_first_dim  # type: ignore[attr-defined]


def adapt_megatron_for_cpu() -> bool:
    """Apply the CPU adaptations once per process; a no-op (returns False) where CUDA exists."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    cpu_torch = _CpuTorch()
    for name in ADAPTED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is not torch:
            raise RuntimeError(
                f"megarl.platform: {name} no longer imports torch as `torch`; "
                "the megatron-core CPU adaptation needs updating for this megatron-core version"
            )
        module.torch = cpu_torch  # type: ignore[attr-defined]  # checked above: it has one
    for module_name, path in TENSOR_METHOD_FUNCTIONS:
        _wrap_tensor_methods(module_name, path)
    _adapt_rng_tracker()
    _adapt_moe()
    _applied = True
    return True


def is_adapted() -> bool:
    return _applied
