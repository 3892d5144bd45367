"""GSM8K answer scoring: the final answer follows "####" (GSM8K's own format).

`compute_score` keeps verl's signature so scorers written for verl port unchanged:
- method="strict": the answer is the number after the last "####"; no "####", no answer.
- method="flexible": the answer is the last number anywhere in the text.
Numbers compare by value after removing thousands separators and a leading "$"
("1,000" == "1000", "18.00" == "18"). A correct answer earns `score`, a wrong one
`format_score` (a reward for answering in the format at all), no answer 0.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_NUM = r"-?\$?\s?\d(?:[\d,]*\d)?(?:\.\d+)?"
_STRICT = re.compile(r"####\s*(" + _NUM + ")")
_ANY_NUMBER = re.compile(_NUM)
METHODS = ("strict", "flexible")


def _normalize(text: str) -> str:
    return text.replace(",", "").replace("$", "").replace(" ", "").strip()


def _value(text: str) -> Decimal | None:
    try:
        v = Decimal(_normalize(text))
    except InvalidOperation:
        return None
    return v if v.is_finite() else None


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer as written (separators removed), or None when there is none."""
    if method == "strict":
        matches = _STRICT.findall(solution_str)
    elif method == "flexible":
        matches = _ANY_NUMBER.findall(solution_str)
    else:
        raise ValueError(f"gsm8k: method must be one of {METHODS}, got {method!r}")
    return _normalize(matches[-1]) if matches else None


def compute_score(
    solution_str: str,
    ground_truth: object,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if it differs, else 0."""
    if ground_truth is None:
        raise ValueError("gsm8k: ground_truth is missing (reward_model.ground_truth is null)")
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    got, want = _value(answer), _value(truth)
    if want is None:  # a non-numeric ground truth compares as text
        return score if answer == _normalize(truth) else format_score
    return score if got is not None and got == want else format_score


FORMAT_CREDIT = 0.1


def score_with_format_credit(
    data_source: str, solution_str: str, ground_truth: object, extra_info: object = None
) -> float:
    """`compute_score` (strict) with `FORMAT_CREDIT` for a wrong answer written after "####".

    A `reward.custom_fn` for small models that rarely answer in GSM8K's format at first: the
    credit gives GRPO a signal to learn the format before the first correct answers appear, and
    stays below a correct answer's 1.0 so pass@k (score >= 1.0) still counts correct answers only.
    """
    return compute_score(solution_str, ground_truth, format_score=FORMAT_CREDIT)
