"""Read a W&B run file (``run-ID.wandb``) back without W&B's servers, for tests.

The file is W&B's transaction log: a 7-byte header (``:W&B``, a 2-byte magic, a version byte),
then 32 KiB blocks of records, each with a 7-byte header (CRC32C, little-endian length, type:
1 full, 2 first, 3 middle, 4 last piece) and a ``wandb_internal_pb2.Record`` protobuf payload.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> Iterator[object]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pieces = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:
            break
        if pos + HEADER + length > len(data):  # its writer is still appending this record
            break
        pieces += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def history(path: Path) -> dict[int, dict[str, object]]:
    """step -> {metric: value} of the history records (what ``run.log`` wrote)."""
    out: dict[int, dict[str, object]] = {}
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
            for item in record.history.item
        }
        out.setdefault(int(items["_step"]), {}).update(items)
    return out
