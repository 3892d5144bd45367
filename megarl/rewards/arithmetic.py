"""Arithmetic answers: the last number of the response against the exact value.

Built in for ``data_source`` ``arithmetic`` (:mod:`megarl.tools.data_prep.arithmetic`). A multi-turn
trajectory is scored on its final model turn, so a tool call alone earns nothing: the model must
state the answer. Thousands separators are ignored ("1,458" == "1458").
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def compute_score(solution_str: str, ground_truth: object) -> float:
    if ground_truth is None:
        raise ValueError("arithmetic: ground_truth is missing (reward_model.ground_truth is null)")
    answer = last_number(solution_str)
    if answer is None:
        return 0.0
    try:
        return 1.0 if float(answer) == float(str(ground_truth)) else 0.0
    except ValueError:
        return 0.0


def score_answer(
    data_source: str, solution_str: str, ground_truth: object, extra_info: object = None
) -> float:
    """`compute_score` in the ``reward.custom_fn`` form (what the learning benchmark gives both
    megarl and TRL, so the two sides score with the same function)."""
    return compute_score(solution_str, ground_truth)
