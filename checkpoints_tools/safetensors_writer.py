"""Write a safetensors file tensor by tensor, holding none of the others in memory.

``safetensors.torch.save_file`` needs every tensor of the file at once (and copies them to
bytes). The format is simple enough to stream: an 8-byte little-endian header length, a JSON
header with each tensor's dtype, shape and byte range, then the raw bytes in that order. Shapes
and dtypes are known before any data is read (from the checkpoint's metadata), so the header is
written first and each tensor goes to disk as soon as it is computed.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

_CODES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class SafetensorsStreamWriter:
    """``write`` the planned tensors in order; ``close`` checks that all were written."""

    def __init__(
        self,
        path: str | Path,
        entries: list[tuple[str, tuple[int, ...], torch.dtype]],
        metadata: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        self._entries = list(entries)
        self._next = 0
        self._rows = 0  # rows of the current tensor written so far
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for name, shape, dtype in self._entries:
            if dtype not in _CODES:
                raise ValueError(f"dtype {dtype} cannot be written to safetensors here")
            size = nbytes(shape, dtype)
            header[name] = {
                "dtype": _CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        self.data_size = offset
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
        self._f = open(self.path, "wb")  # noqa: SIM115 (closed in close())
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next planned tensor, whole or as consecutive blocks of its rows."""
        if self._next >= len(self._entries):
            raise ValueError(f"{self.path.name}: {name} was not planned for this file")
        want, shape, dtype = self._entries[self._next]
        shape = tuple(shape)
        got = tuple(tensor.shape)
        whole = got == shape and self._rows == 0
        rows_fit = (
            len(got) == len(shape) > 0 and got[1:] == shape[1:] and self._rows + got[0] <= shape[0]
        )
        if name != want or tensor.dtype != dtype or not (whole or rows_fit):
            raise ValueError(
                f"{self.path.name}: expected {want} {shape} {dtype} (rows {self._rows} written), "
                f"got {name} {got} {tensor.dtype}"
            )
        data = tensor.detach().to("cpu").contiguous()
        if data.numel():
            self._f.write(data.reshape(-1).view(torch.uint8).numpy())
        self._rows += got[0] if got else 0
        if not shape or self._rows == shape[0]:
            self._next += 1
            self._rows = 0

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.close()
        if self._next != len(self._entries):
            missing = [n for n, _, _ in self._entries[self._next :]]
            raise ValueError(f"{self.path.name}: tensors never written: {missing[:5]}...")

    def __enter__(self) -> SafetensorsStreamWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()
