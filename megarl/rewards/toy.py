"""A trivially learnable reward for CPU smoke runs and the quickstart (not a benchmark of anything).

``vowel_rate`` scores a response by the share of its letters that are vowels. A randomly
initialised model starts near the vocabulary's average and can raise it within a few dozen GRPO
steps on a laptop CPU, so the reward curve shows learning end to end in minutes.
"""

from __future__ import annotations

_VOWELS = frozenset("aeiouAEIOU")


def vowel_rate(
    data_source: str, solution_str: str, ground_truth: object = None, extra_info: object = None
) -> float:
    letters = [c for c in solution_str if c.isalpha()]
    if not letters:
        return 0.0
    return sum(c in _VOWELS for c in letters) / len(letters)


def vowel_majority(
    data_source: str, solution_str: str, ground_truth: object = None, extra_info: object = None
) -> float:
    """1.0 when more than half of the response's letters are vowels, else 0.0: a pass/fail
    version of :func:`vowel_rate`, so that whole groups of samples often score alike (what
    DAPO's dynamic sampling filters) and pass@k means something."""
    return 1.0 if vowel_rate(data_source, solution_str) > 0.5 else 0.0
