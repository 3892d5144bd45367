"""Hugging Face safetensors folder -> megarl checkpoint (megatron dist checkpoint + HF assets).

Each rank of a TP x PP layout builds its shard of the model, reads only its slices of the
safetensors files (:func:`megarl.models.loading.load_hf_into_model`) and saves it with megatron's
``dist_checkpointing``: the result loads at any other TP/PP, and is the format training saves
and resumes from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megarl.checkpoint.hf_assets import dims_from_config, hf_role
from megarl.checkpoint.store import save_checkpoint
from megarl.dtypes import dtype_from_name
from megarl.errors import CheckpointError, ConfigError
from megarl.models.build import ModelOptions, build_gpt_model
from megarl.models.dims import ModelDims, read_hf_config
from megarl.models.heads import has_scalar_head
from megarl.models.hf_map import HEAD_MAPS, tensor_maps
from megarl.models.loading import load_hf_into_model
from megarl.models.safetensors_io import SafetensorsReader
from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel

_CONFIG_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class HfSource:
    """A checked Hugging Face input: its config, dims, role and whether it has a value head."""

    hf_dir: Path
    dims: ModelDims
    role: str
    has_value_head: bool
    dtype: str


def check_hf_source(
    hf_dir: str | Path, layout: ParallelLayout, role: str | None = None, dtype: str = "auto"
) -> HfSource:
    """Validate everything about the input before any process starts: config, layout, tensors."""
    hf_dir = Path(hf_dir)
    cfg = read_hf_config(hf_dir)
    dims = dims_from_config(cfg)
    source_role = hf_role(cfg)
    role = role or source_role
    if has_scalar_head(source_role) and role != source_role:
        raise ConfigError(
            f"{hf_dir} is a {source_role} model ({(cfg.get('architectures') or ['?'])[0]}); "
            f"convert it with --role {source_role}"
        )
    layout.check_model(dims.shape)
    if dtype == "auto":
        named = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        dtype = named if named in _CONFIG_DTYPES else "float32"
    dtype_from_name(dtype)
    reader = SafetensorsReader(hf_dir)
    head_names = {h for maps in HEAD_MAPS.values() for tm in maps for h in tm.hf}
    missing = []
    for tm in tensor_maps(dims, role):
        for layer in range(dims.num_layers) if tm.per_layer else [None]:
            for expert in range(dims.num_experts) if tm.per_expert else [None]:
                for name in tm.hf:
                    name = name.format(layer=layer, expert=expert)
                    if not reader.has(name) and not (source_role != role and name in head_names):
                        missing.append(name)
    if missing:
        raise CheckpointError(
            f"{hf_dir} lacks {len(missing)} tensors its config.json implies (e.g. "
            f"{missing[:3]}); the download or export is partial, or config.json belongs to "
            "another model"
        )
    return HfSource(hf_dir, dims, role, has_scalar_head(role) and source_role == role, dtype)


def hf_to_mcore(
    source: HfSource, out: str | Path, layout: ParallelLayout, *, overwrite: bool = False
) -> Path:
    """Convert on every rank of ``layout`` (collective; torch.distributed initialised)."""

    rank = dist.get_rank()
    t0 = time.perf_counter()
    initialize_model_parallel(layout)
    try:
        opts = ModelOptions(dtype=dtype_from_name(source.dtype))
        model = build_gpt_model(source.dims, layout, source.role, opts)
        load_hf_into_model(model, source.hf_dir, source.dims, layout, role=source.role)
        loaded = time.perf_counter()
        path = save_checkpoint(
            out,
            model,
            role=source.role,
            hf_assets=source.hf_dir,
            overwrite=overwrite,
            source=str(source.hf_dir.absolute()),
        )
    finally:
        destroy_model_parallel()
    if rank == 0:
        note = ""
        if has_scalar_head(source.role) and not source.has_value_head:
            note = f" (the {source.role} head starts fresh: the source is a causal LM)"
        print(
            f"hf-to-mcore: {source.hf_dir} -> {path} as {source.role} ({source.dtype}) at "
            f"{layout}{note}: load {loaded - t0:.1f}s, save {time.perf_counter() - loaded:.1f}s"
        )
    return path
