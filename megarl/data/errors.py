"""The exception type for user-causable data problems (bad files, columns, state, settings)."""

from __future__ import annotations

from megarl.errors import MegarlError


class DataError(MegarlError, ValueError):
    """A problem with the user's data or data settings; the message names the file, column and fix."""
