"""Pins every CUDA-only call site of the megatron-core modules megarl loads.

megarl.platform adapts the modules in ADAPTED_MODULES wholesale and wraps the functions in
TENSOR_METHOD_FUNCTIONS. If a megatron-core upgrade adds, moves or removes a CUDA-only call in
an adapted module, or a module megarl loads gains one without an adaptation, these tests fail
and name the site. List a module's sites after an upgrade with
``python -m megarl.platform_sites MODULE``.

Beyond megatron's CUDA calls: every change megarl makes to a library's behaviour (an assignment to
an attribute of a library module, a warning filter) is listed in megarl.adaptations.ADAPTATIONS.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from megarl import platform
from megarl.adaptations import ADAPTATIONS, Adaptation
from megarl.platform_sites import dotted_name, module_sites
from tests.import_graph import modules

PINNED_SITES = {
    "megatron.core.utils": {
        ("GlobalMemoryBuffer.get_tensor", "torch.cuda.current_device"),
        ("GlobalSymmetricMemoryBuffer.__init__", 'device="cuda"'),
        ("StragglerDetector.__init__", "torch.cuda.Event"),
        ("StragglerDetector.configure", "torch.cuda.Event"),
        ("StragglerDetector.configure", "torch.cuda.current_device"),
        ("StragglerDetector.elapsed", "torch.cuda.clock_rate"),
        ("StragglerDetector.elapsed", "torch.cuda.power_draw"),
        ("StragglerDetector.elapsed", "torch.cuda.synchronize"),
        ("StragglerDetector.elapsed", "torch.cuda.temperature"),
        ("StragglerDetector.elapsed", "torch.cuda.utilization"),
        ("StragglerDetector.start_method", "torch.cuda.Event"),
        ("check_param_hashes_across_dp_replicas", ".cuda()"),
        ("get_batch_on_this_hybrid_cp_rank", 'device="cuda"'),
        ("local_multi_tensor_l2_norm", 'device="cuda"'),
        ("nvtx_range_pop", "torch.cuda.nvtx"),
        ("nvtx_range_push", "torch.cuda.nvtx"),
    },
    "megatron.core.transformer.utils": {
        ("get_default_causal_mask", 'device="cuda"'),
        ("get_sliding_window_causal_mask", 'device="cuda"'),
    },
    "megatron.core.transformer.attention": {
        ("Attention._allocate_memory", "torch.cuda.current_device"),
    },
    "megatron.core.transformer.dot_product_attention": {
        ("DotProductAttention.__init__", "torch.cuda.current_device"),
    },
    "megatron.core.transformer.transformer_layer": {
        (
            "TransformerLayer._get_te_cuda_graph_replay_args.get_zero_attention_mask",
            "torch.cuda.current_device",
        ),
        ("TransformerLayer.get_layer_static_inputs", "torch.cuda.current_device"),
    },
    "megatron.core.models.common.embeddings.rotary_pos_embedding": {
        ("MultimodalRotaryEmbedding.__init__", "torch.cuda.current_device"),
        ("RotaryEmbedding.__init__", "torch.cuda.current_device"),
        ("RotaryEmbedding.get_emb", "torch.cuda.current_device"),
    },
    "megatron.core.tensor_parallel.random": {
        ("CudaRNGStatesTracker.__init__", "torch.cuda.CUDAGraph"),
        ("CudaRNGStatesTracker.add", "torch.cuda.get_rng_state"),
        ("CudaRNGStatesTracker.add", "torch.cuda.manual_seed"),
        ("_get_cuda_rng_state", "torch.cuda.current_device"),
        ("_get_cuda_rng_state", "torch.cuda.default_generators"),
        ("_get_cuda_rng_state", "torch.cuda.random"),
        ("_set_cuda_rng_state.cb", "torch.cuda.current_device"),
        ("_set_cuda_rng_state.cb", "torch.cuda.default_generators"),
        ("model_parallel_cuda_manual_seed", "torch.cuda.manual_seed"),
    },
    "megatron.core.tensor_parallel.layers": {
        ("<module>", "torch.cuda.amp"),
        ("ColumnParallelLinear.__init__", "torch.cuda.current_device"),
        ("LinearWithGradAccumulationAndAsyncCommunication.backward", "torch.cuda.current_device"),
        ("RowParallelLinear.__init__", "torch.cuda.current_device"),
        ("VocabParallelEmbedding.__init__", "torch.cuda.current_device"),
    },
    "megatron.core.tensor_parallel.mappings": {
        ("_AllToAll.forward", "torch.cuda.current_device"),
        ("_gather_along_first_dim", "torch.cuda.current_device"),
        ("_gather_along_last_dim", "torch.cuda.current_device"),
        ("_reduce_scatter_along_first_dim", "torch.cuda.current_device"),
    },
    "megatron.core.tensor_parallel.data": {
        ("_build_key_size_numel_dictionaries", 'device="cuda"'),
        ("broadcast_data", ".cuda()"),
        ("broadcast_data", "torch.cuda.current_device"),
    },
    "megatron.core.pipeline_parallel.schedules": {
        ("forward_backward_no_pipelining", 'device="cuda"'),
        ("forward_backward_pipelining_with_interleaving", 'device="cuda"'),
        ("forward_backward_pipelining_without_interleaving", 'device="cuda"'),
    },
    "megatron.core.pipeline_parallel.p2p_communication": {
        ("P2PCommunicator._communicate", "torch.cuda.synchronize"),
        ("P2PCommunicator._communicate.create_tensor_recv_next", "torch.cuda.current_device"),
        ("P2PCommunicator._communicate.create_tensor_recv_prev", "torch.cuda.current_device"),
        ("P2PCommunicator._communicate_shapes", "torch.cuda.current_device"),
        ("P2PCommunicator._communicate_shapes", "torch.cuda.synchronize"),
    },
    "megatron.core.distributed.param_and_grad_buffer": {
        ("_ParamAndGradBucketGroup.finish_grad_sync", "torch.cuda.default_stream"),
        ("_ParamAndGradBucketGroup.start_grad_sync", "torch.cuda.default_stream"),
        ("_ParamAndGradBucketGroup.start_grad_sync", "torch.cuda.stream"),
        ("_ParamAndGradBuffer.__init__", 'device="cuda"'),
        ("_ParamAndGradBuffer.__init__", "torch.cuda.current_device"),
    },
    "megatron.core.distributed.distributed_data_parallel": {
        ("DistributedDataParallel.__init__._allocate_buffers_for_parameters", "torch.cuda.Stream"),
        (
            "DistributedDataParallel.__init__._allocate_buffers_for_parameters",
            "torch.cuda.current_device",
        ),
        ("DistributedDataParallel.offload_grad_buffers", "torch.cuda.empty_cache"),
        ("DistributedDataParallel.offload_grad_buffers", "torch.cuda.synchronize"),
        ("DistributedDataParallel.restore_grad_buffers", "torch.cuda.synchronize"),
    },
    "megatron.core.optimizer.clip_grads": {
        ("clip_grad_by_total_norm_fp32", 'device="cuda"'),
        ("clip_grad_by_total_norm_fp32", "type()==cuda"),
        ("count_zeros_fp32", 'device="cuda"'),
        ("get_grad_norm_fp32", 'device="cuda"'),
    },
    "megatron.core.optimizer.optimizer": {
        ("ChainedOptimizer.get_loss_scale", "torch.cuda.current_device"),
        ("FP32Optimizer.__init__", 'device="cuda"'),
        ("Float16OptimizerWithFloat16Params.__init__", "type()==cuda"),
        ("MegatronOptimizer.offload_to_cpu", "torch.cuda.empty_cache"),
        ("MegatronOptimizer.restore_from_cpu", ".cuda()"),
        ("MixedPrecisionOptimizer.__init__", 'device="cuda"'),
    },
    "megatron.core.optimizer.distrib_optimizer": {
        ("DistributedOptimizer.__init__", "type()==cuda"),
        ("DistributedOptimizer._build_model_and_main_param_groups", "type()==cuda"),
        ("DistributedOptimizer.get_parameter_state_dp_zero", ".cuda()"),
        ("DistributedOptimizer.get_parameter_state_dp_zero", "torch.cuda.current_device"),
        ("DistributedOptimizer.load_state_dict", "torch.cuda.current_device"),
    },
    "megatron.core.dist_checkpointing.exchange_utils": {
        ("_get_empty_tensor_for_exchange", 'device="cuda"'),
        ("exchange_loaded_tensors_broadcast", ".cuda()"),
        ("exchange_loaded_tensors_gather_rounds", ".cuda()"),
        ("exchange_loaded_tensors_gather_rounds", 'device="cuda"'),
    },
    "megatron.core.dist_checkpointing.tensor_aware_state_dict": {
        ("MCoreTensorAwareStateDict._insert_sharded_data", "torch.cuda.synchronize"),
    },
    "megatron.core.dist_checkpointing.strategies.async_utils": {
        ("AsyncCaller.sync_all_async_calls", "torch.cuda.current_device"),
        ("AsyncCallsQueue.maybe_finalize_async_calls", "torch.cuda.current_device"),
        ("PersistentAsyncCaller.async_loop", "torch.cuda.device_count"),
        ("PersistentAsyncCaller.async_loop", "torch.cuda.set_device"),
        ("TemporalAsyncCaller.schedule_async_call", "torch.cuda.synchronize"),
    },
    "megatron.core.dist_checkpointing.strategies.filesystem_async": {
        ("FileSystemWriterAsync.preload_tensors", "torch.cuda.synchronize"),
    },
    "megatron.core.dist_checkpointing.strategies.fully_parallel": {
        ("FullyParallelLoadStrategyWrapper.load", "torch.cuda.synchronize"),
    },
    "megatron.core.transformer.moe.router": {
        ("Router.gating", "torch.cuda.current_device"),
        ("TopKRouter.__init__", "torch.cuda.current_device"),
    },
    "megatron.core.transformer.moe.token_dispatcher": {
        ("MoEAlltoAllTokenDispatcher.__init__", "torch.cuda.Stream"),
        ("MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", "torch.cuda.current_stream"),
        ("MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", "torch.cuda.stream"),
    },
    "megatron.core.transformer.moe.moe_utils": {
        ("maybe_move_tensor_to_cpu", "torch.cuda.current_stream"),
        ("track_moe_metrics", 'device="cuda"'),
    },
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": {
        ("save_state_dict_async_finalize", "torch.cuda.current_device"),
        ("verify_global_md_reuse", 'device="cuda"'),
    },
}

# Modules megarl loads that contain CUDA-only calls on paths it never takes on CPU, and why.
NOT_ON_THE_CPU_PATH = {
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter": "Megatron-FSDP: megarl uses DDP + distributed optimizer",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp": "Megatron-FSDP: megarl uses DDP + distributed optimizer",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision": "Megatron-FSDP: megarl uses DDP + distributed optimizer",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer": "Megatron-FSDP: megarl uses DDP + distributed optimizer",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor": "Megatron-FSDP: megarl uses DDP + distributed optimizer",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.utils": "Megatron-FSDP: megarl uses DDP + distributed optimizer",
    "megatron.core.extensions.transformer_engine": "Transformer Engine: GPU only, not imported on CPU",
    "megatron.core.fp8_utils": "FP8: GPU only",
    "megatron.core.fusions.fused_indices_converter": "MoE fusions: megarl sets moe_permute_fusion false",
    "megatron.core.fusions.fused_pad_routing_map": "MoE fusions: megarl sets moe_permute_fusion false",
    "megatron.core.inference.batch_dimensions_utils": "megatron inference engines: rollout is vLLM",
    "megatron.core.inference.contexts.attention_context.mamba_metadata": "megatron inference engines: rollout is vLLM",
    "megatron.core.inference.contexts.attention_context.mha_metadata": "megatron inference engines: rollout is vLLM",
    "megatron.core.inference.contexts.dynamic_block_allocator": "megatron inference engines: rollout is vLLM",
    "megatron.core.inference.contexts.dynamic_context": "megatron inference engines: rollout is vLLM",
    "megatron.core.inference.inference_request": "megatron inference engines: rollout is vLLM",
    "megatron.core.inference.unified_memory": "megatron inference engines: rollout is vLLM",
    "megatron.core.inference.utils": "megatron inference engines: rollout is vLLM",
    "megatron.core.models.common.embeddings.rope_utils": "context parallelism only (cp=1 here)",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": "YaRN rope: not a supported rope type",
    "megatron.core.models.common.language_module.language_module": "adapted by TENSOR_METHOD_FUNCTIONS",
    "megatron.core.models.gpt.gpt_model": "static-batching inference path only",
    "megatron.core.nccl_allocator": "NCCL user buffers: GPU only",
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer": "optimizer CPU offload: GPU only",
    "megatron.core.optimizer.grad_scaler": "loss scaling: fp16 only",
    "megatron.core.parallel_state": "only with NCCL options / timeouts updates",
    "megatron.core.pipeline_parallel.combined_1f1b": "MoE A2A overlap schedule",
    "megatron.core.pipeline_parallel.fine_grained_activation_offload": "activation offload: GPU only",
    "megatron.core.pipeline_parallel.hybrid_cp_schedule": "context parallelism only",
    "megatron.core.pipeline_parallel.utils": "MoE A2A overlap streams",
    "megatron.core.rerun_state_machine": "rerun/fault injection: disabled by default",
    "megatron.core.tensor_parallel.inference_layers": "megatron inference layers",
    "megatron.core.tensor_parallel.utils": "split/gather 1-D helpers used by sequence-parallel scatter (off)",
    "megatron.core.timers": "megatron timers: megarl times phases itself",
    "megatron.core.transformer.cuda_graphs": "CUDA graphs: GPU only",
    "megatron.core.transformer.mlp": "OOM fallback of the swiglu checkpoint merge (catches torch.cuda.OutOfMemoryError, which exists on CPU torch)",
    "megatron.core.transformer.module": "Float16Module type tables (fp16/bf16 on GPU) and CUDA-graph inputs",
    "megatron.core.transformer.moe.experts": "grouped-GEMM experts: megarl builds sequential experts",
    "megatron.core.transformer.moe.shared_experts": "shared experts: no supported family has them",
    "megatron.core.transformer.multi_token_prediction": "MTP: off",
}


@pytest.mark.parametrize("module", platform.ADAPTED_MODULES)
def test_adapted_module_sites_are_pinned(module):
    found = module_sites(module)
    pinned = PINNED_SITES[module]
    assert found == pinned, (
        f"{module}: CUDA-only call sites changed; new: {sorted(found - pinned)}, "
        f"gone: {sorted(pinned - found)}. Review megarl/platform.py for this megatron-core version."
    )


@pytest.mark.parametrize(("module", "path"), platform.TENSOR_METHOD_FUNCTIONS)
def test_wrapped_functions_still_call_cuda_tensor_methods(module, path):
    kinds = {kind for qualname, kind in module_sites(module) if qualname == path}
    assert kinds & {".cuda()", "type()==cuda"}, (
        f"{module}.{path} no longer calls a CUDA-only tensor method"
    )


_LOAD_MEGARL_PATHS = """
import json
from megarl import platform
platform.adapt_megatron_for_cpu()
import megatron.core.dist_checkpointing, megatron.core.optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
import megarl.checkpoint, megarl.models.build, megarl.models.distributed, megarl.models.export
import megarl.models.forward, megarl.trainer.loop
megarl.models.build.layer_spec()
from megarl.platform_sites import loaded_megatron_modules
print(json.dumps(loaded_megatron_modules()))
"""


def test_no_unadapted_module_with_cuda_calls():
    """In a fresh process (so other tests' imports don't count), import what megarl's CPU paths
    use, and require every loaded megatron module with CUDA-only calls to be adapted or explained."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _LOAD_MEGARL_PATHS], capture_output=True, text=True, check=True
    )
    unexplained = []
    for module in json.loads(out.stdout.strip().splitlines()[-1]):
        if module in platform.ADAPTED_MODULES or module in NOT_ON_THE_CPU_PATH:
            continue
        try:
            sites = module_sites(module)
        except (ModuleNotFoundError, SyntaxError, OSError):
            continue
        if sites:
            unexplained.append((module, sorted(sites)))
    assert not unexplained, (
        f"megatron modules with CUDA-only calls that megarl.platform does not adapt: {unexplained}"
    )


def test_adaptation_is_scoped_to_megatron():
    """The real torch stays untouched for everyone else (vLLM decode slowed 15-20% with a global patch)."""
    import torch

    platform.adapt_megatron_for_cpu()
    import megatron.core.transformer.utils as mutils

    assert mutils.torch is not torch
    assert mutils.torch.cuda.current_device() == torch.device("cpu")
    assert (
        torch.Tensor.cuda is not None and torch.Tensor.type(torch.zeros(1)) == "torch.FloatTensor"
    )
    mask = mutils.get_default_causal_mask(4)
    assert mask.device.type == "cpu" and mask.dtype == torch.bool and mask.sum().item() == 6


LIBRARIES = ("megatron", "vllm", "transformers", "torch", "ray")
WARNING_FILTERS = ("warnings.filterwarnings", "warnings.simplefilter")


def _is_library(module: str) -> bool:
    return module.split(".")[0] in LIBRARIES


def _library_names(tree: ast.Module) -> set[str]:
    """Names the file binds to a library module or a name inside one (at the top or in a body)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if _is_library(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {a.asname or a.name for a in node.names} if _is_library(node.module) else set()
    return names


def _adapts(node: ast.AST, library: set[str]) -> bool:
    if isinstance(node, ast.Call):
        func = dotted_name(node.func)
        if func in WARNING_FILTERS:
            return True
        target = node.args[0] if func == "setattr" and node.args else None
    elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(
            isinstance(t, ast.Attribute) and dotted_name(t).split(".")[0] in library
            for t in targets
        )
    else:
        return False
    return target is not None and dotted_name(target).split(".")[0] in library


def _scopes(tree: ast.Module) -> list[tuple[str | None, list[ast.AST]]]:
    """(function or Class.method, its statements) of a module, and (None, the module's others)."""
    out: list[tuple[str | None, list[ast.AST]]] = []
    top: list[ast.AST] = []
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            out.append((stmt.name, [stmt]))
        elif isinstance(stmt, ast.ClassDef):
            out += [
                (f"{stmt.name}.{f.name}", [f])
                for f in stmt.body
                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            ]
        else:
            top.append(stmt)
    return [*out, (None, top)]


def library_adaptation_sites(root: str = "megarl") -> set[str]:
    """``module:function`` (``module`` at module level) of every adaptation under ``root``."""
    sites = set()
    for module, path in modules(packages=(root,)).items():
        if module.startswith(f"{root}.tools"):
            continue
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        library = _library_names(tree)
        for scope, stmts in _scopes(tree):
            if any(_adapts(n, library) for stmt in stmts for n in ast.walk(stmt)):
                sites.add(f"{module}:{scope}" if scope else module)
    return sites


def _helpers(a: Adaptation) -> set[str]:
    module = a.by.partition(":")[0]
    return {f"{module}:{helper}" for helper in a.helpers}


def _registered() -> set[str]:
    return {site for a in ADAPTATIONS for site in ({a.by} | _helpers(a))}


def test_the_adaptation_finder_sees_assignments_setattr_and_warning_filters():
    code = """
import warnings
from megatron.core import utils
import torch
def swap():
    utils.fn = None
def wrap(owner):
    setattr(torch.Tensor, "cuda", None)
    owner.x = 1  # not a library
warnings.filterwarnings("ignore")
"""
    tree = ast.parse(code)
    library = _library_names(tree)
    found = {
        s
        for s, stmts in _scopes(tree)
        if any(_adapts(n, library) for t in stmts for n in ast.walk(t))
    }
    assert found == {"swap", "wrap", None}
    assert not any(
        _adapts(n, library) for n in ast.walk(ast.parse("def f(owner):\n    owner.x = 1"))
    )


def test_every_library_adaptation_is_registered():
    found = library_adaptation_sites()
    assert "megarl.models.rotary:use_cached_rotary" in found  # the finder sees the rope swap
    unlisted = sorted(found - _registered())
    assert not unlisted, (
        "these change a library's behaviour (an attribute of a library module, a warning filter) "
        f"but are not in megarl.adaptations.ADAPTATIONS: list them there: {unlisted}"
    )
    stale = [a.by for a in ADAPTATIONS if not ({a.by} | _helpers(a)) & found]
    assert not stale, f"ADAPTATIONS lists adaptations no code makes any more: {stale}"


@pytest.mark.parametrize("adaptation", ADAPTATIONS, ids=lambda a: a.by)
def test_registered_adaptations_name_real_functions(adaptation):
    module_name, _, function = adaptation.by.partition(":")
    module = importlib.import_module(module_name)
    for name in [function, *adaptation.helpers] if function else adaptation.helpers:
        assert callable(getattr(module, name)), (adaptation.by, name)
