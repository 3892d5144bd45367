"""Load a Hugging Face safetensors checkpoint straight into this rank's megatron model shard."""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.errors import CheckpointError
from megarl.models.dims import ModelDims
from megarl.models.hf_map import NameIndex, hf_to_megatron_shard
from megarl.models.safetensors_io import SafetensorsReader
from megarl.parallel import ParallelLayout


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def mapped_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters that come from the HF checkpoint (a critic's fresh value head is left out)."""
    from megarl.models.build import ValueHead

    gpt = unwrap(model)
    skip = "output_layer." if isinstance(getattr(gpt, "output_layer", None), ValueHead) else None
    return [(n, p) for n, p in gpt.named_parameters() if not (skip and n.startswith(skip))]


@torch.no_grad()
def load_hf_into_model(model, hf_dir: str | Path, dims: ModelDims, layout: ParallelLayout) -> None:
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
    )
    pp_rank = ps.get_pipeline_model_parallel_rank()
    from megarl.models.build import layer_offset

    index = NameIndex(dims, layer_offset(dims, layout, pp_rank))
    reader = SafetensorsReader(hf_dir)
    for name, param in mapped_parameters(model):
        tm, hf_names = index.lookup(name)
        shard = hf_to_megatron_shard(tm, hf_names, reader, dims, tp_rank, tp_size)
        if tuple(shard.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{hf_names} in {hf_dir} give a shard of shape {tuple(shard.shape)} for megatron "
                f"parameter {name} of shape {tuple(param.shape)}; the checkpoint does not match its config.json"
            )
        param.copy_(shard.to(param.dtype))
