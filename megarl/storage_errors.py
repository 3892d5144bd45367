"""OS errors a user causes while a run writes (a full disk, a quota, a folder without write
permission, a read-only filesystem), told as one line naming the path and the fix.

Wherever the write happens (a checkpoint shard in megatron's writer, ``metrics.jsonl``, a logger's
file), the error reaches the rank's entry point; :func:`storage_error` finds the OS error in the
exception's chain (or its text, where a library re-raised it as another type) and gives the
:class:`StorageError` the entry point prints as ``megarl: error: ...`` with exit status 2.
Nothing is lost by stopping there: a checkpoint becomes visible only once complete
(megarl.checkpoint.atomic), so ``latest`` names the previous one and a rerun resumes from it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

from megarl.errors import MegarlError

_RESUME = "then run the same command again: it resumes from the last complete checkpoint"
# errno -> (what happened, the fix)
FIXES: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("the disk is full", "free space on that filesystem or choose another "),
    errno.EDQUOT: ("the disk quota is used up", "free space, raise the quota or choose another "),
    errno.EACCES: ("permission denied", "give this user write permission there or choose another "),
    errno.EPERM: ("operation not permitted", "fix the folder's permissions or choose another "),
    errno.EROFS: ("the filesystem is read-only", "choose another "),
}
# the ones whose text says what it is (permission errors' text is too common to read so)
_TOLD_AS_TEXT = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class StorageError(MegarlError):
    """A write the machine refused for a reason the user can fix (space, permissions)."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]


def _errno_of(exc: BaseException) -> tuple[int, str | None] | None:
    """The errno (and file) of the first user-fixable OS error in ``exc``'s chain."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in FIXES:
            name = e.filename if isinstance(e.filename, str | Path) else None
            return e.errno, None if name is None else str(name)
    for e in _chain(exc):  # re-raised as text (torch's stream writer, megatron's async saves)
        text = str(e)
        for code in _TOLD_AS_TEXT:
            if os.strerror(code) in text:
                return code, None
    return None


def storage_error(exc: BaseException, output_dir: str | None = None) -> StorageError | None:
    """The one-line error for ``exc`` if a full disk, a quota, permissions or a read-only
    filesystem caused it; None for anything else. ``output_dir``: named when the error does not
    say which file it was writing."""
    found = _errno_of(exc)
    if found is None:
        return None
    code, path = found
    what, fix = FIXES[code]
    where = path or (f"a file in trainer.output_dir={output_dir}" if output_dir else "a file")
    return StorageError(
        f"cannot write {where}: {what} ([Errno {code}]). Fix: {fix}trainer.output_dir; {_RESUME}"
    )
