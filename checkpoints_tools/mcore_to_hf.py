"""Megatron dist checkpoint -> Hugging Face folder, streamed tensor by tensor.

No model is built and no process group is needed: every megatron tensor is read from the
checkpoint as a *global* tensor (whatever TP/PP it was saved at), turned into its Hugging Face
tensors by the shared name map (:mod:`megarl.models.hf_map`), and written straight into a
safetensors shard (:class:`SafetensorsStreamWriter`). One process holds one tensor at a time;
embeddings and LM heads, the largest tensors, go to disk one saved (vocab-parallel) chunk at a
time without being assembled. Several processes (torchrun) split the shard files between them.

The output is written into a hidden temporary folder and renamed at the end.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoints_tools.finite import check_finite
from checkpoints_tools.lora_export import (
    MergeDeltas,
    check_lora_export,
    checkpoint_lora,
    export_adapter,
)
from checkpoints_tools.safetensors_writer import SafetensorsStreamWriter, nbytes
from megarl.checkpoint.hf_assets import asset_files, export_config, has_tokenizer, read_json
from megarl.checkpoint.keys import dist_checkpoint_key
from megarl.checkpoint.reader import DistCheckpointReader
from megarl.checkpoint.store import (
    HF_SUBDIR,
    MCORE_SUBDIR,
    checkpoint_dims,
    read_meta,
    resolve_checkpoint,
    staged_output,
)
from megarl.data.chat import pad_token_id
from megarl.dtypes import dtype_from_name, dtype_name
from megarl.errors import CheckpointError
from megarl.models.dims import ModelDims
from megarl.models.heads import has_scalar_head
from megarl.models.hf_map import TensorMap, megatron_shards_to_hf, tensor_maps

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class Group:
    """One megatron tensor of the checkpoint and the Hugging Face tensors it becomes."""

    tm: TensorMap
    key: str  # dist-checkpoint key
    # layer index into a stacked key, (layer, expert) for an expert's weight (None: the whole tensor)
    index: int | tuple[int, int] | None
    hf: tuple[tuple[str, tuple[int, ...]], ...]  # (hf name, shape), in write order
    source_shape: tuple[int, ...]

    def out_bytes(self, dtype: torch.dtype) -> int:
        return sum(nbytes(shape, dtype) for _, shape in self.hf)

    def read(self, reader: DistCheckpointReader) -> torch.Tensor:
        return reader.read(self.key, self.index)

    @property
    def streams_rows(self) -> bool:
        """A whole tensor copied as is (embedding, LM head): written chunk by chunk."""
        return self.tm.kind == "copy" and self.index is None and len(self.hf) == 1

    def convert(self, full: torch.Tensor, dims: ModelDims) -> list[tuple[str, torch.Tensor]]:
        """HF tensors of this group from the megatron global (TP-unsplit) tensor."""
        names = tuple(n for n, _ in self.hf)
        return megatron_shards_to_hf(self.tm, names, [full], dims)


def _ordered_maps(dims: ModelDims, role: str) -> Iterator[tuple[TensorMap, int | None, int | None]]:
    """(map, layer, expert) in Hugging Face order: embeddings, layer 0..L-1 (an MoE layer's
    experts one by one), final norm, head."""
    maps = tensor_maps(dims, role)
    if not has_scalar_head(role) and dims.tie_word_embeddings:
        # The tied LM head is the embedding: HF stores it once (model.embed_tokens.weight).
        maps = [tm for tm in maps if tm.megatron != "output_layer.weight"]
    first = [tm for tm in maps if not tm.per_layer and tm.megatron.startswith("embedding.")]
    layered = [tm for tm in maps if tm.per_layer]
    last = [tm for tm in maps if not tm.per_layer and tm not in first]
    yield from ((tm, None, None) for tm in first)
    for layer in range(dims.num_layers):
        for tm in layered:
            for expert in range(dims.num_experts) if tm.per_expert else [None]:
                yield tm, layer, expert
    yield from ((tm, None, None) for tm in last)


def plan_groups(dims: ModelDims, role: str, reader: DistCheckpointReader) -> list[Group]:
    """Every checkpoint tensor to export, with its HF names and shapes (from metadata only)."""
    groups = []
    for tm, layer, expert in _ordered_maps(dims, role):
        key = dist_checkpoint_key(tm.megatron)
        index: int | tuple[int, int] | None
        if layer is None:
            index = None
            shape = reader.shape(key)
            names = tm.hf
        else:
            key, index = reader.layer_key(key, layer)
            shape = reader.shape(key)[1:] if index is not None else reader.shape(key)
            if expert is not None:  # experts stacked along the next dim
                index = (index, expert) if index is not None else expert
                shape = shape[1:]
            names = tuple(h.format(layer=layer, expert=expert) for h in tm.hf)
        try:
            meta = megatron_shards_to_hf(tm, names, [torch.empty(shape, device="meta")], dims)
        except RuntimeError as e:
            raise CheckpointError(
                f"checkpoint tensor {key!r} of shape {shape} does not fit the model in "
                f"hf/config.json ({e}); the config does not belong to this checkpoint"
            ) from e
        hf = tuple((n, tuple(t.shape)) for n, t in meta)
        groups.append(Group(tm, key, index, hf, tuple(shape)))
    return groups


def plan_shards(groups: list[Group], dtype: torch.dtype, max_bytes: int) -> list[list[Group]]:
    """Split groups (never a group) into files of at most ``max_bytes`` (a larger group alone)."""
    shards: list[list[Group]] = [[]]
    size = 0
    for g in groups:
        b = g.out_bytes(dtype)
        if shards[-1] and size + b > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += b
    return shards


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _rank_world() -> tuple[int, int]:

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="export",
        disable=not enabled,
        file=sys.stderr,
        mininterval=0.5,
    )


def _write_shard(
    path: Path,
    groups: list[Group],
    reader: DistCheckpointReader,
    dims: ModelDims,
    dtype: torch.dtype,
    bar,
    lora: MergeDeltas | None = None,
) -> None:
    entries = [(n, shape, dtype) for g in groups for n, shape in g.hf]
    with SafetensorsStreamWriter(path, entries) as writer:
        for g in groups:
            if g.streams_rows:
                for block in reader.row_blocks(g.key):
                    # Cast in slices of ~16 MiB: a dtype change never doubles the chunk.
                    step = max(1, (16 << 20) // max(1, block[:1].numel() * block.element_size()))
                    check_finite(g.hf[0][0], block, reader.root.parent)
                    for rows in block.split(step):
                        writer.write(g.hf[0][0], rows.to(dtype))
                    del block
            else:
                full = g.read(reader)
                for name, t in g.convert(full, dims):
                    if lora is not None:
                        t = lora.apply(name, t)
                    t = t.to(dtype)
                    check_finite(name, t, reader.root.parent)
                    writer.write(name, t)
                    del t
                del full
            bar.update(g.out_bytes(dtype))


def _generation_config(cfg: dict) -> dict:
    out = {"_from_model_config": True}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(k) is not None:
            out[k] = cfg[k]
    if cfg.get("transformers_version"):
        out["transformers_version"] = cfg["transformers_version"]
    return out


def _pad_token_id(hf_src: Path) -> int | None:
    """The tokenizer's pad id (else its eos id): where transformers' sequence classifier stops."""
    if not has_tokenizer(hf_src):
        return None
    from transformers import AutoTokenizer

    return pad_token_id(AutoTokenizer.from_pretrained(hf_src))


def _write_side_files(tmp: Path, hf_src: Path, cfg: dict, role: str, dtype: torch.dtype) -> None:
    (tmp / "config.json").write_text(
        json.dumps(
            export_config(
                cfg, role, dtype_name(dtype), _pad_token_id(hf_src) if role == "reward" else None
            ),
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )

    for path in asset_files(hf_src, skip=("config.json",)):  # links out of it are refused
        shutil.copy2(path, tmp / path.name)
    if not has_scalar_head(role) and not (tmp / "generation_config.json").exists():
        (tmp / "generation_config.json").write_text(
            json.dumps(_generation_config(cfg), indent=2) + "\n"
        )


@dataclass
class ExportResult:
    out: Path
    files: int
    tensors: int
    bytes: int
    seconds: float
    role: str
    dtype: str


def export_to_hf(
    ckpt: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = True,
    lora: str | None = None,
) -> ExportResult:
    """Write the checkpoint ``ckpt`` as a Hugging Face folder ``out``.

    Actor and reference checkpoints become ``*ForCausalLM`` folders; a critic becomes
    ``*ForTokenClassification`` with one label (its value head is ``score``). Collective when
    torch.distributed is initialised: ranks split the shard files. A checkpoint with LoRA
    adapters needs ``lora``: ``merged`` (base + scale * B @ A in every adapted weight) or
    ``adapter`` (a peft adapter folder instead, :mod:`checkpoints_tools.lora_export`).
    """
    t0 = time.perf_counter()
    ckpt = resolve_checkpoint(ckpt)
    meta = read_meta(ckpt)
    check_lora_export(meta, lora, ckpt)
    if lora == "adapter":
        done = export_adapter(ckpt, out, dtype=dtype, overwrite=overwrite)
        return ExportResult(
            done.out, 1, done.tensors, done.bytes, done.seconds, meta.role, dtype or meta.dtype
        )
    dims = checkpoint_dims(ckpt)
    cfg = read_json(ckpt / HF_SUBDIR / "config.json")
    out_dtype = dtype_from_name(dtype or meta.dtype)
    rank, world = _rank_world()
    with DistCheckpointReader(ckpt / MCORE_SUBDIR) as reader:
        settings = checkpoint_lora(meta)
        deltas = MergeDeltas(reader, dims, settings) if settings is not None else None
        groups = plan_groups(dims, meta.role, reader)
        shards = plan_shards(groups, out_dtype, max_shard_bytes)
        n = len(shards)
        mine = [i for i in range(n) if i % world == rank]
        total = sum(g.out_bytes(out_dtype) for i in mine for g in shards[i])
        with staged_output(out, overwrite=overwrite) as tmp:
            with _progress(total, progress and rank == 0) as bar:
                for i in mine:
                    _write_shard(
                        tmp / shard_file_name(i, n), shards[i], reader, dims, out_dtype, bar, deltas
                    )
            if rank == 0:
                weight_map = {
                    name: shard_file_name(i, n)
                    for i, shard in enumerate(shards)
                    for g in shard
                    for name, _ in g.hf
                }
                index = {
                    "metadata": {
                        "total_size": sum(g.out_bytes(out_dtype) for g in groups),
                        "total_parameters": sum(math.prod(s) for g in groups for _, s in g.hf),
                    },
                    "weight_map": weight_map,
                }
                (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
                _write_side_files(tmp, ckpt / HF_SUBDIR, cfg, meta.role, out_dtype)
    if rank == 0 and not has_tokenizer(ckpt / HF_SUBDIR):
        print(
            f"note: {ckpt / HF_SUBDIR} has no tokenizer files; the export has none either "
            "(vLLM then needs skip_tokenizer_init=True)",
            file=sys.stderr,
        )
    return ExportResult(
        out=Path(out).absolute(),
        files=n,
        tensors=sum(len(g.hf) for g in groups),
        bytes=sum(g.out_bytes(out_dtype) for g in groups),
        seconds=time.perf_counter() - t0,
        role=meta.role,
        dtype=dtype_name(out_dtype),
    )


def iter_checkpoint_hf_tensors(
    ckpt: str | Path,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) of a checkpoint in HF order and the checkpoint's dtype, one at a time."""
    ckpt = resolve_checkpoint(ckpt)
    meta = read_meta(ckpt)
    dims = checkpoint_dims(ckpt)
    with DistCheckpointReader(ckpt / MCORE_SUBDIR) as reader:
        for g in plan_groups(dims, meta.role, reader):
            yield from g.convert(g.read(reader), dims)
