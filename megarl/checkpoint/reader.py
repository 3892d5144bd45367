"""Read global tensors of a megatron dist checkpoint one at a time, without torch.distributed.

megatron-core's ``torch_dist`` format is a PyTorch Distributed Checkpoint: a ``.metadata`` file
listing every tensor's global shape and the chunks each saving rank wrote (offsets, sizes, and
where in which ``.distcp`` file each chunk's ``torch.save`` bytes lie). Reading a chunk needs one
``torch.load`` of those bytes: this reader loads exactly the chunks a request overlaps, so memory
stays at one tensor (plus one chunk) whatever the model size, and any process can read a
checkpoint saved at any TP/PP.

Per-layer parameters are stored stacked, ``decoder.layers.<param>`` with the global layer index as
the first dimension (megatron-core's default), or one key per layer
(``decoder.layers.<i>.<param>``, "non-homogeneous layers"); :meth:`layer_key` handles both.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import torch

from megarl.checkpoint.contained import inside
from megarl.checkpoint.safe_metadata import DIST_METADATA, read_dist_metadata, refused_pickle
from megarl.errors import CheckpointError

MEGATRON_METADATA = "metadata.json"


class _FileView(io.RawIOBase):
    """A read-only window ``[offset, offset+length)`` of an open file (what ``torch.load`` reads)."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b)[:n])
        self._pos += got
        return got


class DistCheckpointReader:
    """Global tensors (or one layer of a stacked tensor) of a megatron dist checkpoint folder."""

    def __init__(self, mcore_dir: str | Path):
        self.root = Path(mcore_dir)
        meta_file = self.root / DIST_METADATA
        if not meta_file.is_file() or not (self.root / MEGATRON_METADATA).is_file():
            raise CheckpointError(
                f"{self.root} is not a complete megatron dist checkpoint ({DIST_METADATA} or "
                f"{MEGATRON_METADATA} is missing); save or convert it again"
            )
        self._md = read_dist_metadata(meta_file)  # allow-listed: never runs code from the file
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self._tensors = {
            k: v
            for k, v in self._md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }
        self._storage = {
            (i.fqn, tuple(i.offset or ())): s for i, s in self._md.storage_data.items()
        }
        self._handles: dict[str, object] = {}
        self._check_files()

    def _check_files(self) -> None:
        """Every data file the metadata names exists and is long enough (no partial copies)."""
        need: dict[str, int] = {}
        for info in self._storage.values():
            end = info.offset + info.length
            need[info.relative_path] = max(need.get(info.relative_path, 0), end)
        for name, end in sorted(need.items()):
            path = inside(self.root, name, f"checkpoint {self.root.parent}")  # no link, no ..
            if not path.is_file():
                raise CheckpointError(
                    f"checkpoint {self.root.parent} is partial: data file {path.name} is missing; "
                    "copy the whole checkpoint folder or save it again"
                )
            if path.stat().st_size < end:
                raise CheckpointError(
                    f"checkpoint {self.root.parent} is partial: {path.name} is truncated "
                    f"({path.stat().st_size} bytes, needs {end}); copy or save it again"
                )

    def close(self) -> None:
        for f in self._handles.values():
            f.close()  # type: ignore[attr-defined]
        self._handles.clear()

    def __enter__(self) -> DistCheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what is inside

    def keys(self) -> list[str]:
        return list(self._tensors)

    def has(self, key: str) -> bool:
        return key in self._tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._md_of(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._md_of(key).properties.dtype

    def chunks(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offsets, sizes) of the pieces ``key`` was saved in (one per saving TP/PP shard)."""
        return [(tuple(c.offsets), tuple(c.sizes)) for c in self._md_of(key).chunks]

    def layer_key(self, stacked_key: str, layer: int) -> tuple[str, int | None]:
        """(key, index along dim 0) of one layer's slice of ``decoder.layers.<param>``."""
        if stacked_key in self._tensors:
            return stacked_key, layer
        prefix = "decoder.layers."
        per_layer = prefix + f"{layer}." + stacked_key[len(prefix) :]
        if per_layer in self._tensors:
            return per_layer, None
        raise CheckpointError(
            f"checkpoint {self.root.parent} has no tensor {stacked_key!r} (nor {per_layer!r}); "
            "it does not hold this model (wrong architecture in hf/config.json, or partial)"
        )

    def _md_of(self, key: str):
        try:
            return self._tensors[key]
        except KeyError:
            raise CheckpointError(
                f"checkpoint {self.root.parent} has no tensor {key!r}; it does not hold this "
                "model (wrong architecture in hf/config.json, or partial)"
            ) from None

    # -- reading

    def _load_chunk(self, key: str, offsets: tuple[int, ...]) -> torch.Tensor:
        info = self._storage.get((key, tuple(offsets)))
        if info is None:
            raise CheckpointError(f"checkpoint metadata lists no data for {key!r} at {offsets}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{key!r} is stored with transforms {info.transform_descriptors} (compression); "
                "megarl reads uncompressed torch_dist checkpoints only"
            )
        f = self._handles.get(info.relative_path)
        if f is None:
            f = open(self.root / info.relative_path, "rb")  # noqa: SIM115 (kept open, closed in close())
            self._handles[info.relative_path] = f
        try:
            return torch.load(
                _FileView(f, info.offset, info.length), map_location="cpu", weights_only=True
            )
        except pickle.UnpicklingError as e:
            raise refused_pickle(f"{self.root / info.relative_path} (at {key!r})", e) from None
        except Exception as e:
            raise CheckpointError(
                f"cannot read {key!r} from {self.root / info.relative_path}: {e}; "
                "the checkpoint is damaged"
            ) from e

    def row_blocks(self, key: str) -> Iterator[torch.Tensor]:
        """The whole tensor ``key`` as consecutive blocks of rows, one stored chunk at a time.

        Tensors split along dim 0 when saved (vocab-parallel embeddings and LM heads) never need
        assembling: concatenating the blocks gives the tensor. Other layouts yield it whole.
        """
        md = self._md_of(key)
        size = tuple(md.size)
        chunks = sorted(md.chunks, key=lambda c: c.offsets[0] if size else 0)
        rows = 0
        for c in chunks:
            full_rows = (
                tuple(c.offsets[1:]) == (0,) * (len(size) - 1) and tuple(c.sizes[1:]) == size[1:]
            )
            if not size or not full_rows or c.offsets[0] != rows:
                yield self.read(key)
                return
            rows += c.sizes[0]
        if rows != size[0]:
            yield self.read(key)
            return
        for c in chunks:
            yield self._load_chunk(key, tuple(c.offsets))

    def read(self, key: str, index: int | tuple[int, ...] | None = None) -> torch.Tensor:
        """The global tensor ``key``, or its slice ``[index]`` along dim 0 (a stacked layer);
        a tuple indexes the leading dims (``(layer, expert)`` of a stacked expert weight)."""
        md = self._md_of(key)
        size = tuple(md.size)
        lo = [0] * len(size)
        hi = list(size)
        leading = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        for dim, i in enumerate(leading):
            if not 0 <= i < size[dim]:
                what = ("layers", "layer") if dim == 0 else ("experts", "expert")
                raise CheckpointError(
                    f"{key!r} has {size[dim]} {what[0]}; {what[1]} {i} is missing"
                )
            lo[dim], hi[dim] = i, i + 1
        region = [h - lo_ for lo_, h in zip(lo, hi, strict=True)]
        parts = []
        for chunk in md.chunks:
            c_lo, c_hi = (
                list(chunk.offsets),
                [o + s for o, s in zip(chunk.offsets, chunk.sizes, strict=True)],
            )
            o_lo = [max(a, b) for a, b in zip(lo, c_lo, strict=True)]
            o_hi = [min(a, b) for a, b in zip(hi, c_hi, strict=True)]
            if all(a < b for a, b in zip(o_lo, o_hi, strict=True)) or not size:
                parts.append((chunk, c_lo, o_lo, o_hi))
        covered = sum(
            math.prod(b - a for a, b in zip(o_lo, o_hi, strict=True)) for _, _, o_lo, o_hi in parts
        )
        if covered != math.prod(region):
            raise CheckpointError(
                f"checkpoint {self.root.parent} holds only part of {key!r} "
                f"({covered} of {math.prod(region)} values); it is partial"
            )
        if len(parts) == 1 and parts[0][1] == lo and list(parts[0][0].sizes) == region:
            # The request is exactly one stored chunk: hand it out without a copy.
            out = self._load_chunk(key, tuple(parts[0][0].offsets))
        else:
            out = torch.empty(region, dtype=md.properties.dtype)
            for chunk, c_lo, o_lo, o_hi in parts:
                data = self._load_chunk(key, tuple(chunk.offsets))
                src = data[
                    tuple(slice(a - c, b - c) for a, b, c in zip(o_lo, o_hi, c_lo, strict=True))
                ]
                dst = out[
                    tuple(slice(a - r, b - r) for a, b, r in zip(o_lo, o_hi, lo, strict=True))
                ]
                dst.copy_(src)
                del data, src
        if tuple(out.shape) != tuple(region):
            raise CheckpointError(
                f"{key!r}: stored chunk has shape {tuple(out.shape)}, expected {region}"
            )
        return out[(0,) * len(leading)] if leading else out
