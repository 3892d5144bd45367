"""A live run holds its output folder: an exclusive ``flock`` on ``OUT/run.lock``.

``megarl train`` takes it before launch and holds it for the run's life, elastic restarts
included; the kernel drops it when the launcher ends, however it ends (its ranks end with it,
megarl.parent_death). Another run into the same folder is refused before launch, naming the live
run (host, pid, start time, which the holder writes into the file). A lock file left by a run
that ended without removing it (killed) holds no lock: it is taken over, with a one-line note.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megarl.errors import ConfigError

LOCK_FILE = "run.lock"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _holder(text: str) -> str:
    """'host H, pid P, started T' from a lock file's record (or what can be said without it)."""
    try:
        record = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record["started"])))
        return f"host {record['host']}, pid {record['pid']}, started {started}"
    except (ValueError, KeyError, TypeError):
        return "no record of its host and pid"


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode(errors="replace")


@dataclass
class RunLock:
    """The held lock of one output folder; :meth:`release` (or the process's end) frees it."""

    path: Path
    fd: int
    created: bool = False  # the folder was made for the lock: removed at release if still empty

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def moved_to(self, aside: Path) -> None:
        """The folder (with this lock file) was renamed to ``aside``: lock a fresh one at the
        original place, then free the moved one."""
        fresh = acquire_run_lock(self.path.parent)
        self.path, self.created = aside / LOCK_FILE, False
        self.release()
        self.path, self.fd, self.created = fresh.path, fresh.fd, fresh.created

    def release(self) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):  # unlinked while held: a waiter re-checks the inode
            self.path.unlink()
        os.close(self.fd)
        self.fd = -1
        if self.created:  # a run refused before it wrote anything leaves no empty folder
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()


def acquire_run_lock(folder: str | Path) -> RunLock:
    """Take ``folder/run.lock`` (creating the folder); ConfigError naming the live run that
    holds it. A stale file of a dead run is taken over with a note on stderr."""
    path = Path(folder) / LOCK_FILE
    try:
        created = not path.parent.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(_read(fd))
                os.close(fd)
                raise ConfigError(
                    f"trainer.output_dir={path.parent} is in use by a live run ({holder}; it "
                    f"holds {path}). Wait for it to end or stop it, or choose another "
                    "trainer.output_dir"
                ) from None
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its holder removed that file as it ended: lock the new one
        stale = _read(fd).strip()
        if stale:
            print(
                f"megarl: note: {path} was left by a run that has ended ({_holder(stale)}); "
                "taking it over",
                file=sys.stderr,
                flush=True,
            )
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except OSError as e:
        raise ConfigError(
            f"cannot lock trainer.output_dir={path.parent} for this run ({e}); check that the "
            "folder is writable, or choose another trainer.output_dir"
        ) from None
    return RunLock(path, fd, created)
