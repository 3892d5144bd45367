"""Read one data-parallel rank's rows, a window of row groups at a time.

The reader turns a shard plan (megarl.data.sharding) into rows: it opens only the files its
pieces live in, reads only their row groups and columns, and converts to Python objects in small
chunks, so memory holds one window of Arrow data plus one chunk of Python rows.
"""

from __future__ import annotations

import bisect
import copy
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from megarl.data.errors import DataError
from megarl.data.parquet_source import ParquetFileInfo, open_parquet
from megarl.data.sharding import Window, plan_windows, shard_pieces, share_bounds

_CHUNK_ROWS = 1024
_OPEN_FILES = 8


def _arrow_indices(positions: np.ndarray) -> pa.Array:
    """Row positions as an Arrow int64 array over their numpy buffer. ``pa.array`` would first
    ask whether they are a pandas object, which imports pandas (about 0.2 s of a rank's first
    step; megarl never uses it)."""
    data = np.ascontiguousarray(positions, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(data), [None, pa.py_buffer(data)])


class ShardReader:
    """Rows of rank `dp_rank`'s share of `files`, epoch by epoch, from any position.

    Each row comes with its uid: its index in the dataset (files in order, rows in file order),
    stable across epochs, ranks and restarts of the same file list.
    """

    def __init__(
        self,
        fs: pafs.FileSystem,
        files: Sequence[ParquetFileInfo],
        *,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        window_rows: int = 8192,
        columns: Sequence[str] | None = None,
    ) -> None:
        """`columns`: the columns to read (None: all); names a file lacks are skipped there."""
        self.fs = fs
        self.files = list(files)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle, self.window_rows = seed, shuffle, window_rows
        self._columns = [
            None if columns is None else [c for c in columns if c in f.schema.names]
            for f in self.files
        ]
        self.total_rows = sum(f.num_rows for f in self.files)
        share_bounds(self.total_rows, dp_rank, dp_size)  # validates the rank
        # uid of row 0 of each (file, row group)
        self._rg_base: list[list[int]] = []
        self._file_base: list[int] = []
        base = 0
        for f in self.files:
            self._file_base.append(base)
            starts = []
            for n in f.row_group_rows:
                starts.append(base)
                base += n
            self._rg_base.append(starts)
        self._open: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        self._plans: dict[int, list[Window]] = {}

    def locate(self, uid: int) -> str:
        """'path: row N' of a uid, for error messages."""
        i = bisect.bisect_right(self._file_base, uid) - 1
        return f"{self.files[i].path}: row {uid - self._file_base[i]}"

    def for_rank(self, dp_rank: int, dp_size: int) -> ShardReader:
        """The same files and settings, read as rank ``dp_rank`` of ``dp_size``."""
        share_bounds(self.total_rows, dp_rank, dp_size)  # validates the rank
        other = copy.copy(self)
        other.dp_rank, other.dp_size = dp_rank, dp_size
        other._open, other._plans = OrderedDict(), {}
        return other

    def set_seed(self, seed: int) -> None:
        self.seed = seed
        self._plans.clear()

    def share_rows(self, epoch: int) -> int:
        """How many rows this rank's share holds in `epoch` (the same for every epoch)."""
        begin, end = share_bounds(self.total_rows, self.dp_rank, self.dp_size)
        return end - begin

    def windows(self, epoch: int) -> list[Window]:
        if epoch not in self._plans:
            pieces = shard_pieces(
                [f.row_group_rows for f in self.files],
                self.dp_rank,
                self.dp_size,
                seed=self.seed,
                epoch=epoch,
                shuffle=self.shuffle,
            )
            self._plans = {
                epoch: plan_windows(
                    pieces,
                    window_rows=self.window_rows,
                    seed=self.seed,
                    epoch=epoch,
                    dp_rank=self.dp_rank,
                    shuffle=self.shuffle,
                )
            }
        return self._plans[epoch]

    def _file(self, index: int) -> pq.ParquetFile:
        pf = self._open.pop(index, None)
        if pf is None:
            pf = open_parquet(self.fs, self.files[index].path, self.files[index].metadata)
            while len(self._open) >= _OPEN_FILES:
                self._open.popitem(last=False)[1].close()
        self._open[index] = pf
        return pf

    def _read_window(self, window: Window) -> list[tuple[pa.Table, int]]:
        """(table, uid of its first row) per piece, only the needed row groups and columns."""
        tables = []
        for p in window.pieces:
            info = self.files[p.file]
            try:
                table = self._file(p.file).read_row_group(
                    p.row_group, columns=self._columns[p.file]
                )
            except (pa.ArrowException, OSError) as e:
                raise DataError(
                    f"{info.path}: reading row group {p.row_group} failed ({e}); the file is "
                    "damaged or truncated: re-create it, or remove it from the data files."
                ) from e
            tables.append(
                (table.slice(p.start, p.num_rows), self._rg_base[p.file][p.row_group] + p.start)
            )
        return tables

    def iter_rows(self, epoch: int, start: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
        """(uid, row) for this rank's share of `epoch`, from the `start`-th row of the share on."""
        skip = start
        for window in self.windows(epoch):
            if skip >= window.num_rows:
                skip -= window.num_rows
                continue
            yield from self._window_rows(window, skip)
            skip = 0

    def _window_rows(self, window: Window, skip: int) -> Iterator[tuple[int, dict[str, Any]]]:
        tables = self._read_window(window)
        bounds = np.cumsum([0] + [t.num_rows for t, _ in tables])
        for lo in range(skip, window.num_rows, _CHUNK_ROWS):
            positions = window.order[lo : lo + _CHUNK_ROWS]
            which = np.searchsorted(bounds, positions, side="right") - 1
            rows: list[Any] = [None] * len(positions)
            uids = [0] * len(positions)
            for t_index in np.unique(which):
                slots = np.flatnonzero(which == t_index)
                table, base = tables[t_index]
                local = positions[slots] - bounds[t_index]
                converted = table.take(_arrow_indices(local)).to_pylist()
                for slot, row, offset in zip(
                    slots.tolist(), converted, local.tolist(), strict=True
                ):
                    rows[slot] = row
                    uids[slot] = base + offset
            yield from zip(uids, rows, strict=True)

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()
