"""The names ``actor.lora.target_modules`` accepts and the checks of the ``actor.lora`` settings.

Pure (no torch, no megatron): the config checks run them before launch, and
:mod:`megarl.models.lora` builds the adapters from the same tables.
"""

from __future__ import annotations

from collections.abc import Sequence

from megarl.errors import ConfigError

# megatron module (local layer spec) -> the Hugging Face projections fused in it, in row order.
MEGATRON_MODULES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
HF_PROJECTIONS: tuple[str, ...] = tuple(p for parts in MEGATRON_MODULES.values() for p in parts)
ALL_LINEAR = "all-linear"


def valid_target_names() -> list[str]:
    return [ALL_LINEAR, *HF_PROJECTIONS, *MEGATRON_MODULES]


def check_lora_settings(rank: int, alpha: float, dropout: float, targets: Sequence[str]) -> None:
    """Refuse settings no adapter can be built from, naming the fix (before launch)."""
    if rank < 0:
        raise ConfigError(f"actor.lora.rank must be >= 0 (0: LoRA off), got {rank}")
    if rank == 0:
        return
    if not alpha > 0:
        raise ConfigError(
            f"actor.lora.alpha must be > 0 with actor.lora.rank={rank}, got {alpha} "
            "(adapters scale by alpha / rank; peft and verl's guide use e.g. alpha 16 at rank 64)"
        )
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"actor.lora.dropout must be in [0, 1), got {dropout}")
    resolve_targets(targets)


def resolve_targets(targets: str | Sequence[str]) -> frozenset[str]:
    """The Hugging Face projections named by ``actor.lora.target_modules``: ``all-linear`` (every
    projection of the decoder layers, the LM head excluded, as in peft), or a list of HF names
    (``q_proj`` ...) and/or megatron module names (``linear_qkv`` = q, k and v ...)."""
    names = [targets] if isinstance(targets, str) else list(targets)
    if not names:
        raise ConfigError(
            f"actor.lora.target_modules is empty; name some of {valid_target_names()}"
        )
    out: set[str] = set()
    for name in names:
        if name == ALL_LINEAR:
            out.update(HF_PROJECTIONS)
        elif name in MEGATRON_MODULES:
            out.update(MEGATRON_MODULES[name])
        elif name in HF_PROJECTIONS:
            out.add(name)
        else:
            raise ConfigError(
                f"actor.lora.target_modules: unknown module {name!r}; valid names: "
                f"{valid_target_names()}"
            )
    return frozenset(out)
