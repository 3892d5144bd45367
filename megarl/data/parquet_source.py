"""Which parquet files a dataset covers, and what their footers say.

Only footers are read here (row counts per row group and the schema), so every rank can describe
the whole dataset cheaply and compute the same shard plan without reading any row data.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from megarl.data.errors import DataError

_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class ParquetFileInfo:
    """One parquet file as its footer describes it."""

    path: str
    row_group_rows: tuple[int, ...]
    schema: pa.Schema
    # Kept so readers open the file without reading its footer a second time.
    metadata: pq.FileMetaData | None = field(default=None, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        return sum(self.row_group_rows)


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Translate a path glob: `**` crosses folders, `*` and `?` stay inside one name."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape("["))
                i += 1
            else:
                body = pattern[i + 1 : end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _split_uri(entry: str, filesystem: pafs.FileSystem | None) -> tuple[pafs.FileSystem, str]:
    if filesystem is not None:
        return filesystem, entry
    if "://" in entry:
        # Globs are resolved by us, not by the URI parser: parse the part before the first wildcard.
        m = _GLOB_CHARS.search(entry)
        head = entry if m is None else entry[: m.start()]
        fs, head_path = pafs.FileSystem.from_uri(head)
        return fs, head_path + ("" if m is None else entry[m.start() :])
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(entry))


def _expand(fs: pafs.FileSystem, entry: str, what: str) -> list[str]:
    m = _GLOB_CHARS.search(entry)
    if m is None:
        info = fs.get_file_info(entry)
        if info.type == pafs.FileType.NotFound:
            raise DataError(f"{what}: file '{entry}' does not exist; check the path.")
        if info.type == pafs.FileType.Directory:
            found = sorted(
                f.path
                for f in fs.get_file_info(pafs.FileSelector(entry, recursive=True))
                if f.type == pafs.FileType.File and f.path.endswith(".parquet")
            )
            if not found:
                raise DataError(
                    f"{what}: folder '{entry}' holds no *.parquet file; point at the files, or "
                    "create them (e.g. python scripts/prepare_gsm8k.py --out DIR)."
                )
            return found
        return [entry]
    base = entry[: m.start()].rsplit("/", 1)[0] or "/"
    regex = _glob_regex(entry)
    base_info = fs.get_file_info(base)
    # List below `base` only as deep as the pattern goes.
    deep = "/" in entry[len(base) + 1 :]
    found = []
    if base_info.type == pafs.FileType.Directory:
        found = sorted(
            f.path
            for f in fs.get_file_info(pafs.FileSelector(base, recursive=deep))
            if f.type == pafs.FileType.File and regex.match(f.path)
        )
    if not found:
        raise DataError(
            f"{what}: the pattern '{entry}' matches no file (searched under '{base}'); check the "
            "path, or create the data (e.g. python scripts/prepare_gsm8k.py --out DIR)."
        )
    return found


def resolve_files(
    spec: str | Sequence[str],
    filesystem: pafs.FileSystem | None = None,
    *,
    what: str = "data files",
) -> tuple[pafs.FileSystem, list[str]]:
    """Expand paths, folders and globs (`*`, `?`, `[..]`, `**`) into a sorted, de-duplicated list.

    `what` names the setting in error messages (e.g. "data.train_files"). Entries may be local
    paths or URIs that pyarrow understands (s3://, hdfs://, gs://); all entries share one
    filesystem. Each entry's matches are sorted; entries keep the order the user gave.
    """
    entries = [spec] if isinstance(spec, str) else list(spec)
    if not entries:
        raise DataError(f"{what} is empty: give one or more parquet paths or globs.")
    fs: pafs.FileSystem | None = filesystem
    paths: list[str] = []
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise DataError(f"{what}: entry {entry!r} is not a path; give strings.")
        entry_fs, entry_path = _split_uri(entry, fs)
        if fs is None:
            fs = entry_fs
        elif type(entry_fs) is not type(fs):
            raise DataError(f"{what}: '{entry}' is on another filesystem than the first entry.")
        paths.extend(p for p in _expand(fs, entry_path, what) if p not in paths)
    assert fs is not None
    return fs, paths


def open_parquet(
    fs: pafs.FileSystem, path: str, metadata: pq.FileMetaData | None = None
) -> pq.ParquetFile:
    """Open a parquet file for reading, turning pyarrow's errors into a DataError naming the file."""
    try:
        return pq.ParquetFile(fs.open_input_file(path), metadata=metadata)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        raise DataError(
            f"{path}: not a readable parquet file ({e}). It may be empty, truncated or not "
            "parquet: re-create it, or remove it from the data files."
        ) from e


def inspect_files(fs: pafs.FileSystem, paths: Sequence[str]) -> list[ParquetFileInfo]:
    """Read the footer of every file; refuse unreadable files and files without rows."""
    infos = []
    for path in paths:
        pf = open_parquet(fs, path)
        try:
            meta = pf.metadata
            rows = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
            schema = pf.schema_arrow
        finally:
            pf.close()
        if sum(rows) == 0:
            raise DataError(f"{path}: has no rows; remove it from the data files or fill it.")
        infos.append(ParquetFileInfo(path=path, row_group_rows=rows, schema=schema, metadata=meta))
    return infos


def fingerprint(files: Sequence[ParquetFileInfo]) -> str:
    """A short id of the dataset's shape (file names and row groups), to refuse resuming on other data.

    Only base names go in, so a dataset copied to another folder or bucket still resumes.
    """
    shape = [[os.path.basename(f.path), list(f.row_group_rows)] for f in files]
    return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]


def distinct_strings(fs: pafs.FileSystem, info: ParquetFileInfo, column: str) -> set[str]:
    """The distinct non-null values of a string column of one file: from the row groups' min/max
    statistics where they agree (one value in the group, no read), else by reading that column
    of the group only."""
    pf = open_parquet(fs, info.path, info.metadata)
    try:
        meta = pf.metadata
        # the column's leaf index (nested columns such as chat-message prompts have several)
        index = next(j for j in range(meta.num_columns) if meta.schema.column(j).path == column)
        out: set[str] = set()
        for i in range(meta.num_row_groups):
            stats = meta.row_group(i).column(index).statistics
            if stats is not None and stats.has_min_max and stats.min == stats.max:
                value = stats.min
                out.add(value.decode() if isinstance(value, bytes) else str(value))
                continue
            values = pf.read_row_group(i, columns=[column]).column(0).unique()
            out.update(str(v) for v in values.to_pylist() if v is not None)
        return out
    finally:
        pf.close()
