"""A checkpoint is read from inside its folder only.

Checkpoints and run folders may come from someone else. Nothing in one may make megarl read a
file outside it: not a symbolic link (a tokenizer file in ``hf/`` pointing at a host secret, a
symlinked ``.distcp``), not a path it names (a ``.metadata`` storage path, a ``manifest.json``
entry, the ``latest`` pointer) that is absolute or climbs out with ``..``. Each refusal names the
entry. The folder the user names itself may be a link (that is the user's choice); what is
inside it may not.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from megarl.errors import CheckpointError


def entry_problem(rel: str) -> str | None:
    """Why ``rel`` is not a relative path that stays inside its folder (None: it is one)."""
    if not isinstance(rel, str) or not rel:
        return "is not a file name"
    if "\\" in rel or "\0" in rel:
        return "is not a plain relative path"
    path = PurePosixPath(rel)
    if path.is_absolute():
        return "is an absolute path, outside its folder"
    if any(part in ("..", ".", "") for part in rel.split("/")):
        return "climbs out of its folder (or is not a plain relative path)"
    return None


def check_entry(rel: str, where: str) -> str:
    """``rel`` if it is a relative path inside its folder, else a CheckpointError naming it."""
    problem = entry_problem(rel)
    if problem is not None:
        raise CheckpointError(
            f"{where} names {rel!r}, which {problem}; megarl reads checkpoint files from inside "
            "the checkpoint only. The checkpoint is damaged or was made to read other files"
        )
    return rel


def link_in(folder: Path, rel: str) -> str | None:
    """The first component of ``folder/rel`` (as a relative path) that is a symbolic link, or
    None. Missing components end the check (the caller reports what is missing)."""
    at = folder
    parts = rel.split("/")
    for i, part in enumerate(parts):
        at = at / part
        try:
            if stat.S_ISLNK(os.lstat(at).st_mode):
                return "/".join(parts[: i + 1])
        except OSError:
            return None
    return None


def inside(folder: Path, rel: str, where: str) -> Path:
    """``folder/rel``, after checking that ``rel`` stays inside and goes through no link."""
    check_entry(rel, where)
    link = link_in(folder, rel)
    if link is not None:
        raise CheckpointError(f"{where}: {link_message(folder, link)}")
    return folder / rel


def link_message(folder: Path, rel: str) -> str:
    try:
        target = os.readlink(folder / rel)
    except OSError:
        target = "?"
    return (
        f"{rel} is a symbolic link (to {target}); a checkpoint's files must be inside it, so "
        "megarl does not follow it. Copy the checkpoint with its files resolved (cp -rL) if the "
        "link is yours"
    )


def links_under(folder: Path) -> list[str]:
    """Every symbolic link below ``folder`` (files and folders; not followed), as sorted
    relative paths."""
    found = []
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            if path.is_symlink():
                found.append(path.relative_to(folder).as_posix())
    return sorted(found)


def refuse_links(folder: Path) -> None:
    """A CheckpointError naming the links below ``folder``, if it holds any."""
    found = links_under(folder)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise CheckpointError(f"checkpoint {folder}: {link_message(folder, found[0])}{more}")


def read_pointer(root: Path, name: str) -> str | None:
    """The folder name a pointer file (``latest``) holds, None when there is none: the file must
    not be a link, and what it names must be one folder inside ``root``."""
    pointer = root / name
    try:
        mode = os.lstat(pointer).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        raise CheckpointError(f"{root}: {link_message(root, name)}")
    if not stat.S_ISREG(mode):
        return None
    text = pointer.read_text(errors="replace").strip()
    problem = entry_problem(text)
    if problem is None and "/" in text:
        problem = "is not a folder directly inside it"
    if problem is not None:
        raise CheckpointError(
            f"{pointer} names {text[:200]!r}, which {problem}; `{name}` must name a checkpoint "
            f"folder inside {root}. Point it at one of them or remove it"
        )
    link = link_in(root, text)
    if link is not None:
        raise CheckpointError(f"{pointer} names {text!r}: {link_message(root, link)}")
    return text
