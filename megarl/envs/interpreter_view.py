"""What of this machine a sandboxed Python program sees: the interpreter and nothing else.

The base interpreter (the venv's ``python`` is a link to it or a copy of it), its standard
library, its shared library when it has one, and the system's shared-library folders
(``/usr/lib*`` and the ``/lib*`` links to them), all read-only at the paths they have here, so
the interpreter finds its prefix as it always does. With ``packages`` the environment's
site-packages folders (numpy, sympy ...) are shown too, read-only. Never shown: home folders,
the project, run folders, checkpoints, ``/etc``, ``/tmp``, the host's ``/proc``.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Top-level folders that hold the system's shared libraries (the dynamic loader among them).
LIBRARY_ROOTS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32")
LIBRARY_LINKS = ("/lib", "/lib64", "/lib32", "/libx32")


@dataclass(frozen=True)
class InterpreterView:
    executable: str  # the base interpreter's real path
    read_only: tuple[str, ...]  # folders and files shown at the same path, read-only
    links: tuple[tuple[str, str], ...]  # (path, target) symbolic links recreated in the view
    sys_path: tuple[str, ...]  # folders added to the program's sys.path (packages)

    @classmethod
    def current(cls, packages: bool = False) -> InterpreterView:
        """The view of the interpreter running this process."""
        base = getattr(sys, "_base_executable", None) or sys.executable
        executable = os.path.realpath(base)
        shown = [executable, os.path.realpath(sysconfig.get_path("stdlib"))]
        libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
        if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and soname:
            shared = Path(libdir) / soname
            if shared.exists():
                shown.append(os.path.realpath(shared))
        shown += [p for p in LIBRARY_ROOTS if os.path.isdir(p) and not os.path.islink(p)]
        links = []
        for path in (*LIBRARY_ROOTS, *LIBRARY_LINKS):
            if os.path.islink(path):
                links.append((path, os.readlink(path)))
            elif path in LIBRARY_LINKS and os.path.isdir(path):
                shown.append(path)
        extra: list[str] = []
        if packages:
            for key in ("purelib", "platlib"):
                folder = os.path.realpath(sysconfig.get_path(key))
                if os.path.isdir(folder) and folder not in extra:
                    extra.append(folder)
        shown += extra
        return cls(executable, tuple(dict.fromkeys(shown)), tuple(links), tuple(extra))
