"""``python -m megarl.quickstart``: the command the README, the Makefile and the scripts use; the
quickstart itself lives with the other tooling in :mod:`megarl.tools.quickstart`."""

from __future__ import annotations

from megarl.tools.quickstart import main

if __name__ == "__main__":
    raise SystemExit(main())
