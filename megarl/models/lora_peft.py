"""LoRA adapters between megarl's megatron model and peft's layout (names and folder format).

peft names the pair of a Hugging Face projection ``model.layers.3.self_attn.q_proj``
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (``[rank, in]``) and
``...lora_B.weight`` (``[out, rank]``); an adapter folder is ``adapter_config.json`` +
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, folder)`` loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from megarl import parallel
from megarl.models.dims import ModelDims, layer_offset
from megarl.models.hf_map import NameIndex
from megarl.models.lora import LoraAdapter, LoraSettings, adapters
from megarl.parallel import ParallelLayout

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_key(hf_module: str, matrix: str) -> str:
    """peft's name of matrix ``A`` or ``B`` of the adapter on HF module ``hf_module``."""
    return f"{PEFT_PREFIX}{hf_module}.lora_{matrix}.weight"


def hf_modules(index: NameIndex, module_name: str, adapter: LoraAdapter) -> dict[str, str]:
    """Part name (``q_proj`` ...) -> the HF module it adapts (global layer index)."""
    _, hf_names = index.lookup(f"{module_name}.weight")
    return {
        part: hf.removesuffix(".weight")
        for part, hf in zip(adapter.part_names, hf_names, strict=True)
    }


def _stage_index(dims: ModelDims, layout: ParallelLayout) -> NameIndex:
    return NameIndex(dims, layer_offset(dims, layout, parallel.pp_rank()))


def _tp_shard(full: torch.Tensor, dim: int | None) -> torch.Tensor:
    if dim is None:
        return full
    tp, rank = parallel.tp_size(), parallel.tp_rank()
    step = full.shape[dim] // tp
    return full.narrow(dim, rank * step, step)


@torch.no_grad()
def load_peft_adapters(
    model, dims: ModelDims, layout: ParallelLayout, tensors: Mapping[str, torch.Tensor]
) -> int:
    """Copy this rank's shards of peft-named adapter tensors into ``model``'s adapters; returns
    how many tensors were copied. A missing tensor of an adapter the model has is an error."""
    index = _stage_index(dims, layout)
    copied = 0
    for name, adapter in adapters(model):
        modules = hf_modules(index, name, adapter)
        split = adapter.split_dims()
        for part in adapter.A:
            for matrix, params in (("A", adapter.A), ("B", adapter.B)):
                key = peft_key(modules[part], matrix)
                if key not in tensors:
                    raise KeyError(f"adapter tensor {key!r} is missing")
                shard = _tp_shard(tensors[key], split[matrix])
                params[part].copy_(shard.to(params[part].dtype))
                copied += 1
    return copied


def _gather(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    if dim is None or parallel.tp_size() == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(parallel.tp_size())]
    dist.all_gather(shards, t.contiguous(), group=parallel.tp_group())
    return torch.cat(shards, dim=dim)


@torch.no_grad()
def iter_stage_adapter_tensors(
    model, dims: ModelDims, layout: ParallelLayout, use_main_grad: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, whole tensor) of every adapter matrix of this pipeline stage, gathered over
    TP (collective over the TP group); with ``use_main_grad`` megatron DDP's gradient of it."""
    index = _stage_index(dims, layout)
    for name, adapter in adapters(model):
        modules = hf_modules(index, name, adapter)
        split = adapter.split_dims()
        for part in adapter.A:
            for matrix, params in (("A", adapter.A), ("B", adapter.B)):
                p = params[part]
                value = p.main_grad if use_main_grad else p
                yield peft_key(modules[part], matrix), _gather(value.detach(), split[matrix])


def peft_config_dict(settings: LoraSettings, targets: list[str], base: str | None) -> dict:
    """peft's ``LoraConfig`` of these adapters, as its ``adapter_config.json`` holds it."""
    from peft import LoraConfig

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=sorted(targets),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )
    return config.to_dict()


def write_peft_folder(
    out: str | Path,
    tensors: Mapping[str, torch.Tensor],
    settings: LoraSettings,
    base: str | None = None,
) -> Path:
    """``adapter_config.json`` + ``adapter_model.safetensors`` in ``out`` (which must exist)."""

    from safetensors.torch import save_file

    out = Path(out)
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    cfg = peft_config_dict(settings, targets, base)
    cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
    (out / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / ADAPTER_WEIGHTS),
        metadata={"format": "pt"},
    )
    return out
