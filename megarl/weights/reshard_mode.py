"""Which reshard mode a run uses: ``rollout.engine.reshard_mode`` resolved against the rollout backend.

- ``shard``: each rank receives only the slices its rollout TP rank loads (the least traffic:
  for Qwen2.5-72B at TP8 x PP4 -> vLLM TP8 about 14 GB per rank instead of 140 GB);
- ``full``: each rank receives every tensor whole and the rollout engine cuts its own slice;
- ``auto`` (the default): ``shard`` where the backend can load slices of this model, else
  ``full``.

vLLM with a mixture-of-experts model takes ``full`` (its fused-MoE loaders cut their own slices,
below). Either way a weight-update call carries whole layers
(:func:`megarl.weights.tensor_list.update_group`): in ``full`` mode one layer's experts,
whole, on every rank (Qwen3-30B-A3B: 1.2 GB in bf16, with the next layer travelling meanwhile);
the memory plan counts two such buckets beside vLLM's weights while the reshard runs.

Pure: it imports neither vLLM nor torch, so the CLI can refuse a bad setting before launch.
"""

from __future__ import annotations

RESHARD_MODES = ("auto", "shard", "full")

# Why a backend cannot load pre-sharded slices of a model (None: it can).
_VLLM_MOE = (
    "vLLM 0.32's fused-MoE expert weight loaders cut their own tensor-parallel slice out of a "
    "whole expert tensor (routed_experts.py: _load_w13/_load_w2 narrow by the TP rank whatever "
    "they are given), so a pre-sharded expert cannot be loaded"
)


def shard_refusal(backend: str, is_moe: bool) -> str | None:
    """Why ``backend`` cannot take shard-mode slices of this model; None when it can."""
    if backend == "vllm" and is_moe:
        return _VLLM_MOE
    return None


def resolve_reshard_mode(requested: str, backend: str, is_moe: bool) -> str:
    """``shard`` or ``full`` for ``rollout.engine.reshard_mode``; raises ValueError (naming the fix)
    for ``shard`` where the backend cannot take slices."""
    if requested not in RESHARD_MODES:
        raise ValueError(
            f"rollout.engine.reshard_mode={requested!r} is not one of {list(RESHARD_MODES)}"
        )
    refusal = shard_refusal(backend, is_moe)
    if requested == "auto":
        return "full" if refusal else "shard"
    if requested == "shard" and refusal:
        raise ValueError(
            f"rollout.engine.reshard_mode=shard with rollout.engine.backend={backend}: {refusal}; set "
            "rollout.engine.reshard_mode=full (or auto)"
        )
    return requested
