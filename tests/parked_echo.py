"""A stand-in rank for tests/unit/test_parked_rank.py: parks like ``megarl.entry``, then prints
what the launcher's go gave it (its arguments and the late variables) as one JSON line."""

from __future__ import annotations

import json
import os

from megarl.parked_rank import GO_FD_ENV, LATE_ENV, await_go

if __name__ == "__main__":
    args = await_go()
    late = {key: os.environ.get(key) for key in LATE_ENV}
    print(json.dumps({"args": args, "late": late, "go_fd_left": GO_FD_ENV in os.environ}))
