"""Lazy, sliced reading of a Hugging Face safetensors checkpoint (one file or a sharded index).

Each rank reads only the rows or columns it owns: ``safe_open(...).get_slice(name)[a:b]`` maps
just those bytes, so loading a 70B model never materialises it whole in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from megarl.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsReader:
    """Name -> file resolution plus lazy slicing; keeps one open handle per shard file."""

    def __init__(self, hf_dir: str | Path):
        self.root = Path(hf_dir)
        self._handles: dict[str, object] = {}
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        index = self.root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(
                    f"{index} is not a valid safetensors index ({e}); re-export the model"
                ) from e
            missing = sorted({f for f in weight_map.values() if not (self.root / f).is_file()})
            if missing:
                raise CheckpointError(
                    f"{self.root} is incomplete: shard files {missing} named in {INDEX_FILE} are missing; "
                    "finish the download or re-export the model"
                )
            return weight_map
        single = self.root / SINGLE_FILE
        if not single.is_file():
            raise CheckpointError(
                f"no safetensors weights in {self.root} (expected {SINGLE_FILE} or {INDEX_FILE}); "
                "megarl loads Hugging Face safetensors checkpoints (convert .bin with transformers' save_pretrained)"
            )
        handle = self._open(SINGLE_FILE)
        return dict.fromkeys(handle.keys(), SINGLE_FILE)

    def _open(self, file: str):
        handle = self._handles.get(file)
        if handle is None:
            path = self.root / file
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(
                    f"cannot read {path}: {e}. The file is truncated or corrupt; re-download or re-export it"
                ) from e
            self._handles[file] = handle
        return handle

    def names(self) -> list[str]:
        return list(self.weight_map)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def _slice(self, name: str):
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(
                f"tensor {name!r} is missing from the checkpoint in {self.root}; "
                "the checkpoint does not match its config.json (wrong architecture or a partial export)"
            )
        return self._open(file).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int = 0
    ) -> torch.Tensor:
        sl = self._slice(name)
        try:
            if dim is None:
                tensor = sl[:]
            elif dim == 0:
                tensor = sl[start:stop]
            elif dim == 1:
                tensor = sl[:, start:stop]
            else:
                raise ValueError(f"slicing along dim {dim} is not supported")
        except SafetensorError as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {self.root}: {e}") from e
        return tensor.contiguous()
