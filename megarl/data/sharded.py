"""What every dataset (RL prompts, preference pairs, SFT rows) shares: files read by footer, this
rank's shard in lockstep batches (DP sharding and epoch shuffling: :mod:`megarl.data.shard_reader`),
a resumable position, and the counters of dropped rows."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import pyarrow.fs as pafs

from megarl.data.batching import Rows, ShardBatches
from megarl.data.errors import DataError
from megarl.data.parquet_source import ParquetFileInfo, fingerprint, inspect_files, resolve_files
from megarl.data.shard_reader import ShardReader

T = TypeVar("T")
TRUNCATION_POLICIES = ("error", "filter", "truncate")


def check_truncation(truncation: str, max_length: int) -> None:
    if truncation not in TRUNCATION_POLICIES:
        raise DataError(f"truncation must be 'error', 'filter' or 'truncate', got {truncation!r}.")
    if max_length < 2:
        raise DataError(f"max_length must be >= 2, got {max_length}.")


def open_files(
    files: str | Sequence[str], filesystem: pafs.FileSystem | None, setting: str
) -> tuple[pafs.FileSystem, list[ParquetFileInfo]]:
    """The files of a setting (paths, folders, globs), their footers read."""
    fs, paths = resolve_files(files, filesystem, what=setting)
    return fs, inspect_files(fs, paths)


class ShardedDataset(Generic[T]):
    """This rank's items in lockstep batches of ``batch_size_per_rank``; ``encode`` turns rows
    into items (None drops a row, counted as ``dropped``)."""

    def __init__(
        self,
        fs: pafs.FileSystem,
        infos: list[ParquetFileInfo],
        encode: Callable[[Rows], list[T | None]],
        *,
        kind: str,
        batch_size_per_rank: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
        drop_last: bool,
        window_rows: int,
        columns: Sequence[str] | None = None,
        counters: Sequence[str] = (),
    ) -> None:
        """``columns``: the only ones read (None: all); ``counters``: the dataset's own counters
        (besides ``dropped`` and ``refilled``), kept in its state from 0."""
        self.files = infos
        self.reader = ShardReader(
            fs,
            infos,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            shuffle=shuffle,
            window_rows=window_rows,
            columns=columns,
        )
        self._locate = self.reader.locate
        self._batches: ShardBatches[T] = ShardBatches(
            self.reader,
            encode,
            kind=kind,
            batch_size=batch_size_per_rank,
            drop_last=drop_last,
            fingerprint=fingerprint(infos),
        )
        for name in counters:
            self._batches.state.counters.setdefault(name, 0)

    @property
    def counters(self) -> dict[str, int]:
        return self._batches.state.counters

    @property
    def steps_per_epoch(self) -> int:
        return self._batches.steps_per_epoch

    @property
    def epoch(self) -> int:
        return self._batches.state.epoch

    @property
    def num_rows(self) -> int:
        """Rows in the whole dataset (all ranks)."""
        return self.reader.total_rows

    def __iter__(self) -> Iterator[list[T]]:
        return iter(self._batches)

    def state_dict(self) -> dict[str, object]:
        return self._batches.state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        self._batches.load_state_dict(state)

    def close(self) -> None:
        self.reader.close()
