"""The local spec's layer norms, usable with megatron's sequence parallelism.

megatron-core 0.16's ``WrappedTorchNorm`` (the norm of the local, non-Transformer-Engine spec)
asserts ``not config.sequence_parallel``. Nothing in a norm itself depends on that: under
sequence parallelism each TP rank normalises its own slice of the sequence with the full,
replicated weight, so each rank's weight gradient covers only its slice. Tagging the weight
``sequence_parallel`` makes megatron's ``finalize_model_grads`` sum those gradients over the TP
group, which restores the full gradient (Transformer Engine's norms carry the same tag).
"""

from __future__ import annotations

import torch

_NORMS = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}


class SequenceParallelTorchNorm:
    """Builds a torch ``RMSNorm``/``LayerNorm`` whose parameters carry megatron's
    ``sequence_parallel`` tag when the config turns sequence parallelism on.

    Same constructor as megatron's norm modules (``build_module`` calls it with the config and
    the hidden size), so it drops into a layer spec in place of ``WrappedTorchNorm``.
    """

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> torch.nn.Module:
        norm_cls = _NORMS.get(config.normalization)
        if norm_cls is None:
            raise ValueError(
                f"normalization {config.normalization!r} is not supported by the local spec; "
                f"known: {sorted(_NORMS)}"
            )
        if config.layernorm_zero_centered_gamma:
            raise ValueError("zero-centred gamma needs Transformer Engine's norms")
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm
