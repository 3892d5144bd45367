"""Built-in rule scorers by `data_source` (the column every prompt row carries).

Entries are spec strings, so worker processes import them by name. Users add or override
entries through RewardManager(scorers={...}); this table itself never changes at run time.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

BUILTIN_SCORERS: Mapping[str, str] = MappingProxyType(
    {
        "openai/gsm8k": "megarl.rewards.gsm8k:compute_score",
        "arithmetic": "megarl.rewards.arithmetic:compute_score",
    }
)
