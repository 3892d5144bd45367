"""Writing files in folders others may have prepared (a run folder, a shared output folder):
never through a link planted under the name written.

- :func:`replace_file` writes a whole file atomically: the bytes go to a temporary file made
  afresh beside the target (an unpredictable name, created exclusively, so no file or link there
  beforehand is ever opened), which then replaces the target's name (a link at the target is
  replaced, not followed).
- :func:`temporary_beside` gives such a temporary file for writers that need a path or a stream
  (``torch.save``, a profiler's trace); :func:`append_text` and :func:`write_text` refuse a
  link at the target (``O_NOFOLLOW``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


@contextlib.contextmanager
def temporary_beside(path: str | Path) -> Iterator[tuple[BinaryIO, Path]]:
    """An exclusively created temporary file in ``path``'s folder (hidden, named after it), open
    for writing; removed if the block fails. Move it into place with ``os.replace``."""
    target = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(name)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as an ordinary new file (mkstemp makes it private)
        with os.fdopen(fd, "wb") as f:
            yield f, tmp
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def replace_file(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` atomically, through a fresh temporary file."""
    target = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    with temporary_beside(target) as (f, tmp):
        f.write(raw)
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return target


def _open_nofollow(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | _NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if path.is_symlink():
            raise OSError(
                e.errno, f"{path} is a symbolic link; megarl does not write through one", str(path)
            ) from None
        raise


def append_text(path: str | Path, text: str) -> None:
    """Append ``text`` to ``path`` (created if missing); a link at ``path`` is refused."""
    fd = _open_nofollow(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "a") as f:
        f.write(text)


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` (created or truncated); a link at ``path`` is refused."""
    fd = _open_nofollow(Path(path), os.O_WRONLY | os.O_TRUNC | os.O_CREAT)
    with os.fdopen(fd, "w") as f:
        f.write(text)
