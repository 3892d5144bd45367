"""Checkpoint manifests: every file of a checkpoint folder with its size and checksum.

A save writes ``manifest.json`` into each checkpoint folder once its files are on disk (the files
are hashed on the rank that wrote them, still in its page cache); resume and ``megarl convert``
compare the folder with it before they read anything else, so a file that changed afterwards (a
flipped byte, a truncated copy, a missing shard) is found and named instead of being loaded.

The checksum is xxHash's XXH3-64 (about 10 GB/s a core from the page cache, read through
``mmap``): cheap beside the write itself, and meant to catch damage, not forgery.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import xxhash

from megarl.checkpoint.contained import check_entry, link_in, link_message
from megarl.errors import CheckpointError
from megarl.files import replace_file

MANIFEST_FILE = "manifest.json"
FORMAT = "megarl.manifest/1"
HASH = "xxh3_64"


@dataclass(frozen=True)
class FileRecord:
    """One file of a manifest: its path relative to the manifest's folder, size and checksum."""

    path: str
    bytes: int
    checksum: str


def checksum(path: Path) -> str:
    """XXH3-64 of the file's bytes, as 16 hex digits."""
    size = path.stat().st_size
    if size == 0:
        return xxhash.xxh3_64(b"").hexdigest()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        return xxhash.xxh3_64(view).hexdigest()


def record(folder: Path, rel: str) -> FileRecord:
    path = folder / rel
    return FileRecord(rel, path.stat().st_size, checksum(path))


_DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")


def writer_rank(rel: str, world: int) -> int:
    """The rank that wrote a checkpoint file: ``__R_I.distcp`` files are rank R's (torch's
    dist-checkpoint writer names them so), every other file rank 0's."""
    m = _DISTCP.match(rel.rpartition("/")[2])
    rank = int(m.group(1)) if m else 0
    return rank if rank < world else 0


def files_under(folder: Path, exclude: Iterable[str] = ()) -> list[str]:
    """Every regular file below ``folder``, as sorted relative POSIX paths, minus ``exclude``."""
    skip = set(exclude)
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = (Path(root) / name).relative_to(folder).as_posix()
            if rel not in skip:
                out.append(rel)
    return sorted(out)


def write(folder: Path, records: Iterable[FileRecord]) -> Path:
    """Write ``folder/manifest.json`` (atomically) listing ``records``."""
    files = {r.path: {"bytes": r.bytes, HASH: r.checksum} for r in sorted(records, key=_path)}
    body = {"format": FORMAT, "hash": HASH, "files": files}
    return replace_file(folder / MANIFEST_FILE, json.dumps(body, indent=1, sort_keys=True) + "\n")


def _path(r: FileRecord) -> str:
    return r.path


def read(folder: Path) -> dict[str, FileRecord] | None:
    """The manifest of ``folder`` by relative path; None when it has none (an older save)."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT or body.get("hash") != HASH:
            raise ValueError(f"format {body.get('format')!r}, hash {body.get('hash')!r}")
        files: Mapping[str, Mapping[str, object]] = body["files"]
        for rel in files:  # a manifest entry never reaches outside the folder, not even by stat
            check_entry(rel, f"{path} (an entry)")
        return {
            rel: FileRecord(rel, int(entry["bytes"]), str(entry[HASH]))  # type: ignore[call-overload]
            for rel, entry in files.items()
        }
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{path} is not a readable megarl manifest ({type(e).__name__}: {e}); the "
            "checkpoint is damaged"
        ) from None


def size_problem(folder: Path, expected: FileRecord) -> str | None:
    """What is wrong with a file that a stat shows (missing, other size); None if nothing."""
    link = link_in(folder, expected.path)
    if link is not None:
        return link_message(folder, link)
    path = folder / expected.path
    if not path.is_file():
        return f"{expected.path} is missing"
    size = path.stat().st_size
    if size != expected.bytes:
        what = "truncated" if size < expected.bytes else "longer than written"
        return (
            f"{expected.path} is {size:,} bytes, its manifest records {expected.bytes:,} ({what})"
        )
    return None


def problem(folder: Path, expected: FileRecord) -> str | None:
    """What is wrong with one file against its record (size, then checksum); None if intact."""
    found = size_problem(folder, expected)
    if found is not None:
        return found
    if checksum(folder / expected.path) != expected.checksum:
        return f"{expected.path}: its bytes differ from what was written (checksum mismatch)"
    return None


def verify(folder: Path, *, full: bool = True) -> list[str]:
    """Problems of ``folder`` against its manifest (paths relative to ``folder``); empty when
    intact. ``full=False`` checks existence and sizes only (a stat per file)."""
    records = read(folder)
    if records is None:
        return []
    check = problem if full else size_problem
    return [p for r in records.values() if (p := check(folder, r)) is not None]
