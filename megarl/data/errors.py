"""The one exception type for user-causable data problems (bad files, columns, state, config)."""

from __future__ import annotations


class DataError(ValueError):
    """A problem with the user's data or data settings; the message names the file, column and fix."""
