"""Memory sizes as users write them ("80GiB", "141GB", "96G") and as the planner prints them."""

from __future__ import annotations

import re

from megarl.errors import ConfigError

GIB = 1 << 30

_FACTORS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": GIB,
    "gib": GIB,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float, what: str = "size", allow_zero: bool = False) -> int:
    """``"80GiB"`` -> bytes. ``GiB``/``G`` are powers of two, ``GB`` powers of ten; a bare number
    is bytes."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return int(text)
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _FACTORS:
        raise ConfigError(
            f"{what} {text!r} is not a memory size; write a number with a unit, e.g. 80GiB, "
            f"141GB or 96G (GiB/G = 2^30 bytes, GB = 10^9 bytes)"
        )
    value = float(match.group(1)) * _FACTORS[unit]
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{what} {text!r} must be larger than zero")
    return int(value)


def gib(n_bytes: float) -> float:
    return n_bytes / GIB


def fmt_gib(n_bytes: float) -> str:
    """Bytes as GiB with one decimal (``"12.3"``), the unit named in the table header."""
    return f"{n_bytes / GIB:.1f}"
