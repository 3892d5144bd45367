"""LoRA adapters of a megarl checkpoint, read without building a model: as a peft adapter folder
(``--lora adapter``), or merged into the exported Hugging Face weights (``--lora merged``).

A checkpoint with adapters (``megarl_checkpoint.json`` records ``lora``) stores each adapter
matrix under ``decoder.layers.<module>.lora.{A,B}.<projection>`` stacked over layers, like the
base weights; the global tensors are peft's ``lora_A`` (``[rank, in]``) and ``lora_B``
(``[out, rank]``) whatever TP/PP the checkpoint was saved at.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoints_tools.finite import check_finite
from megarl.checkpoint.keys import dist_checkpoint_key
from megarl.checkpoint.reader import DistCheckpointReader
from megarl.checkpoint.store import (
    MCORE_SUBDIR,
    CheckpointMeta,
    checkpoint_dims,
    read_meta,
    resolve_checkpoint,
    staged_output,
)
from megarl.dtypes import dtype_from_name
from megarl.errors import CheckpointError
from megarl.lora_settings import MEGATRON_MODULES, resolve_targets
from megarl.models.dims import ModelDims
from megarl.models.hf_map import NameIndex
from megarl.models.lora import LoraSettings
from megarl.models.lora_peft import peft_key, write_peft_folder

LORA_EXPORTS = ("merged", "adapter")
_MODULE_PATHS = {
    "linear_qkv": "self_attention.linear_qkv",
    "linear_proj": "self_attention.linear_proj",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
}


def checkpoint_lora(meta: CheckpointMeta) -> LoraSettings | None:
    if not meta.lora:
        return None
    lora = meta.lora
    return LoraSettings(
        rank=int(lora["rank"]),
        alpha=float(lora["alpha"]),
        dropout=float(lora.get("dropout", 0.0)),
        target_modules=tuple(lora["target_modules"]),
    )


def check_lora_export(meta: CheckpointMeta, lora: str | None, ckpt: Path) -> None:
    """A checkpoint with adapters must say how to export them; one without has none to export."""
    if lora is not None and lora not in LORA_EXPORTS:
        raise CheckpointError(f"--lora {lora!r}: choose one of {list(LORA_EXPORTS)}")
    if meta.lora and lora is None:
        raise CheckpointError(
            f"checkpoint {ckpt} holds LoRA adapters (rank {meta.lora['rank']}): pass "
            "--lora merged (a Hugging Face model with the adapters merged into its weights) or "
            "--lora adapter (a peft adapter folder for the base model)"
        )
    if lora is not None and not meta.lora:
        raise CheckpointError(f"checkpoint {ckpt} holds no LoRA adapters; leave out --lora")


@dataclass(frozen=True)
class AdapterPair:
    """Where one projection's adapter matrices are in the checkpoint."""

    hf_module: str  # e.g. model.layers.3.self_attn.q_proj
    a_key: tuple[str, int | None]
    b_key: tuple[str, int | None]


def adapter_pairs(
    dims: ModelDims, reader: DistCheckpointReader, settings: LoraSettings
) -> Iterator[AdapterPair]:
    """Every adapter of the checkpoint, layer by layer, in the name map's HF names."""
    targets = resolve_targets(settings.target_modules)
    index = NameIndex(dims, 0)
    for layer in range(dims.num_layers):
        for module, parts in MEGATRON_MODULES.items():
            path = f"decoder.layers.{{layer}}.{_MODULE_PATHS[module]}"
            _, hf_names = index.lookup(f"decoder.layers.{layer}.{_MODULE_PATHS[module]}.weight")
            for part, hf in zip(parts, hf_names, strict=True):
                if part not in targets:
                    continue
                keys = [
                    reader.layer_key(dist_checkpoint_key(f"{path}.lora.{m}.{part}"), layer)
                    for m in ("A", "B")
                ]
                yield AdapterPair(hf.removesuffix(".weight"), keys[0], keys[1])


def read_adapters(ckpt: str | Path) -> tuple[dict[str, torch.Tensor], LoraSettings]:
    """Every adapter matrix of a checkpoint under peft's names, and the adapters' settings."""
    ckpt = resolve_checkpoint(ckpt)
    meta = read_meta(ckpt)
    settings = checkpoint_lora(meta)
    if settings is None:
        raise CheckpointError(f"checkpoint {ckpt} holds no LoRA adapters")
    dims = checkpoint_dims(ckpt)
    out: dict[str, torch.Tensor] = {}
    with DistCheckpointReader(ckpt / MCORE_SUBDIR) as reader:
        for pair in adapter_pairs(dims, reader, settings):
            out[peft_key(pair.hf_module, "A")] = reader.read(*pair.a_key)
            out[peft_key(pair.hf_module, "B")] = reader.read(*pair.b_key)
    return out, settings


class MergeDeltas:
    """``scale * B @ A`` of each adapted HF weight, read from the checkpoint when asked."""

    def __init__(self, reader: DistCheckpointReader, dims: ModelDims, settings: LoraSettings):
        self.reader = reader
        self.scale = settings.scale
        self.pairs = {f"{p.hf_module}.weight": p for p in adapter_pairs(dims, reader, settings)}

    def apply(self, hf_name: str, weight: torch.Tensor) -> torch.Tensor:
        pair = self.pairs.get(hf_name)
        if pair is None:
            return weight
        a = self.reader.read(*pair.a_key).to(torch.float32)
        b = self.reader.read(*pair.b_key).to(torch.float32)
        merged = weight.to(torch.float32) + self.scale * (b @ a)
        return merged.to(weight.dtype)


@dataclass
class AdapterExport:
    out: Path
    tensors: int
    bytes: int
    seconds: float


def export_adapter(
    ckpt: str | Path, out: str | Path, *, dtype: str | None = None, overwrite: bool = False
) -> AdapterExport:
    """A peft adapter folder (adapter_config.json + adapter_model.safetensors) from ``ckpt``."""

    t0 = time.perf_counter()
    ckpt = resolve_checkpoint(ckpt)
    meta = read_meta(ckpt)
    tensors, settings = read_adapters(ckpt)
    if dtype is not None:
        cast = dtype_from_name(dtype)
        tensors = {k: v.to(cast) for k, v in tensors.items()}
    for name, tensor in tensors.items():
        check_finite(name, tensor, ckpt)

    with staged_output(out, overwrite=overwrite) as tmp:
        if not dist.is_initialized() or dist.get_rank() == 0:
            write_peft_folder(tmp, tensors, settings, base=meta.source)
    return AdapterExport(
        out=Path(out).absolute(),
        tensors=len(tensors),
        bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        seconds=time.perf_counter() - t0,
    )
