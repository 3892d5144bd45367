"""Load a Hugging Face safetensors checkpoint straight into this rank's megatron model shard."""

from __future__ import annotations

from pathlib import Path

import torch

from megarl import parallel
from megarl.errors import CheckpointError
from megarl.models.dims import ModelDims, expert_offset, layer_offset, read_hf_config
from megarl.models.heads import has_scalar_head, hf_folder_role
from megarl.models.hf_map import NameIndex, hf_to_megatron_shard
from megarl.models.safetensors_io import SafetensorsReader
from megarl.models.value_head import ValueHead
from megarl.parallel import ParallelLayout


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def mapped_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The trunk's parameters and the LM head; a scalar head (critic, reward) and LoRA adapters
    (:mod:`megarl.models.lora`, no Hugging Face tensor of the base) are left out."""
    gpt = unwrap(model)
    skip = "output_layer." if isinstance(getattr(gpt, "output_layer", None), ValueHead) else None
    return [
        (n, p)
        for n, p in gpt.named_parameters()
        if not (skip and n.startswith(skip)) and ".lora." not in n
    ]


@torch.no_grad()
def load_hf_into_model(
    model, hf_dir: str | Path, dims: ModelDims, layout: ParallelLayout, role: str = "actor"
) -> None:
    """Copy this rank's shard of every mapped tensor of ``hf_dir`` into ``model``.

    A scalar head (critic, reward) is loaded too when ``hf_dir`` is a folder of that role;
    otherwise it keeps its fresh start.
    """

    tp_rank, tp_size = parallel.tp_rank(), parallel.tp_size()
    pp_rank = parallel.pp_rank()
    index = NameIndex(
        dims,
        layer_offset(dims, layout, pp_rank),
        role=role,
        expert_offset=expert_offset(dims, parallel.ep_rank(), parallel.ep_size()),
    )
    # an expert's weights split over expert tensor parallelism, the rest over TP
    etp_rank, etp_size = (parallel.etp_rank(), parallel.etp_size()) if dims.is_moe else (0, 1)
    reader = SafetensorsReader(hf_dir)
    params = mapped_parameters(model)
    if has_scalar_head(role) and hf_folder_role(read_hf_config(hf_dir)) == role:
        gpt = unwrap(model)
        params += [(n, p) for n, p in gpt.named_parameters() if n.startswith("output_layer.")]
    for name, param in params:
        tm, hf_names = index.lookup(name)
        rank, size = (etp_rank, etp_size) if tm.per_expert else (tp_rank, tp_size)
        shard = hf_to_megatron_shard(tm, hf_names, reader, dims, rank, size)
        if tuple(shard.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{hf_names} in {hf_dir} give a shard of shape {tuple(shard.shape)} for megatron "
                f"parameter {name} of shape {tuple(param.shape)}; the checkpoint does not match its config.json"
            )
        param.copy_(shard.to(param.dtype))
