"""Checksums of a dist checkpoint's data files taken from the bytes as they are written.

Hashing the files after the save reads them back: from the page cache on a quiet machine, from
the disk when memory is short, which can cost a third of the save again. Instead, while megarl
saves, the files megatron-core's writer opens for ``.distcp`` data go through :class:`HashingFile`,
which feeds every byte it writes to XXH3-64 and, when the file closes, leaves the size and digest
in a small sidecar beside it (``__R_I.distcp.xxh3``): the writer runs in forked worker processes,
and a file is the one channel back that needs nothing of theirs. :func:`take_sidecar` reads it
(and removes it); a file without one (a writer that changed, a seek) is hashed by reading it.

megatron-core 0.16 opens each data file with ``open_file = open`` inside
``FileSystemWriterAsync.write_preloaded_data`` (strategies/filesystem_async.py); :func:`hashed_writes`
gives that module its own ``open`` for the duration of a save (pinned by
``tests/unit/test_checkpoint_safety.py``).
"""

from __future__ import annotations

import builtins
import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import xxhash

SIDECAR = ".xxh3"
_WRITER_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"


class HashingFile:
    """A binary file open for writing whose bytes are hashed on their way to it."""

    def __init__(self, path: str | os.PathLike, raw: IO[bytes]) -> None:
        self.path = os.fspath(path)
        self._raw = raw
        self._hash = xxhash.xxh3_64()
        self._bytes = 0
        self._sequential = True

    def write(self, data: bytes | bytearray | memoryview) -> int:
        n = self._raw.write(data)
        view = memoryview(data).cast("B")
        self._hash.update(view if n is None or n == len(view) else view[:n])
        self._bytes += len(view) if n is None else n
        return n

    def seek(self, *args: int) -> int:
        self._sequential = False  # the bytes written no longer follow each other: no digest
        return self._raw.seek(*args)

    def close(self) -> None:
        if self._raw.closed:
            return
        self._raw.close()
        if self._sequential:
            Path(self.path + SIDECAR).write_text(f"{self._bytes} {self._hash.hexdigest()}\n")

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            self._sequential = False
        self.close()

    def __getattr__(self, name: str) -> object:  # tell, flush, fileno, closed, ...
        return getattr(self._raw, name)


def hashing_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    """``open`` for megatron's writer: data files written whole are hashed as they are written."""
    raw = builtins.open(file, mode, *args, **kwargs)  # noqa: SIM115 (the caller closes it)
    if mode == "wb" and os.fspath(file).endswith(".distcp"):
        return HashingFile(file, raw)
    return raw


@contextmanager
def hashed_writes() -> Iterator[None]:
    """Around a ``dist_checkpointing.save``: its data files leave digests beside them."""

    module = importlib.import_module(_WRITER_MODULE)
    had = "open" in vars(module)
    previous = vars(module).get("open")
    module.open = hashing_open  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if had:
            module.open = previous  # type: ignore[attr-defined]
        else:
            del module.open


def take_sidecar(path: Path) -> str | None:
    """The digest the writer left for ``path`` if it matches the file's size (removing the
    sidecar either way); None when there is none to trust."""
    sidecar = path.with_name(path.name + SIDECAR)
    try:
        size, digest = sidecar.read_text().split()
    except (OSError, ValueError):
        return None
    finally:
        sidecar.unlink(missing_ok=True)
    return digest if int(size) == path.stat().st_size else None
