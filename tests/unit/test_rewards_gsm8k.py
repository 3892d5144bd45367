"""The gsm8k scorer on answers written the way models and GSM8K write them."""

from __future__ import annotations

import pytest

from megarl.rewards.gsm8k import (
    FORMAT_CREDIT,
    compute_score,
    extract_solution,
    score_with_format_credit,
)

COT = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"

# (answer, ground truth, strict score, flexible score) with score=1, format_score=0
TABLE = [
    (COT + "#### 72", "72", 1.0, 1.0),  # GSM8K's own format
    (COT + "#### 71", "72", 0.0, 0.0),  # wrong
    (COT + "The answer is 72.", "72", 0.0, 1.0),  # missing ####: strict finds nothing
    (
        "#### 72\nI hope this helps! Let me know if you have other questions.",
        "72",
        1.0,
        1.0,
    ),  # extra text after
    ("Total: 1,000 + 234 = 1,234\n#### 1,234", "1234", 1.0, 1.0),  # commas in numbers
    ("It costs $1,234.\n#### $1,234", "1234", 1.0, 1.0),  # dollar sign
    ("4 - 9 = -5\n#### -5", "-5", 1.0, 1.0),  # negative
    ("4 - 9 = -5\n#### 5", "-5", 0.0, 0.0),  # sign matters
    ("####72", "72", 1.0, 1.0),  # no space
    ("#### 72.00", "72", 1.0, 1.0),  # same value
    ("#### 72.", "72", 1.0, 1.0),  # sentence-ending period
    ("first #### 10, then corrected\n#### 72", "72", 1.0, 1.0),  # the last #### counts
    ("#### 72 apples, or maybe 73", "72", 1.0, 0.0),  # flexible takes the last number
    ("I don't know.", "72", 0.0, 0.0),  # no number at all
    ("", "72", 0.0, 0.0),
    ("#### ", "72", 0.0, 0.0),
    ("#### 18", 18, 1.0, 1.0),  # integer ground truth
]


@pytest.mark.parametrize(("answer", "truth", "strict", "flexible"), TABLE)
def test_score_table(answer: str, truth: object, strict: float, flexible: float) -> None:
    assert compute_score(answer, truth) == strict
    assert compute_score(answer, truth, method="strict") == strict
    assert compute_score(answer, truth, method="flexible") == flexible


def test_format_score_and_score_are_configurable() -> None:
    assert compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert compute_score("no final answer", "72", format_score=0.1) == 0.0, (
        "no answer earns nothing"
    )
    assert compute_score("#### 72", "72", format_score=0.1, score=2.0) == 2.0


def test_extract_solution() -> None:
    assert extract_solution(COT + "#### 1,234") == "1234"
    assert extract_solution(COT) is None
    assert extract_solution(COT, "flexible") == "72"


def test_bad_method_and_missing_truth_raise() -> None:
    with pytest.raises(ValueError, match=r"method must be one of \('strict', 'flexible'\)"):
        compute_score("#### 1", "1", method="loose")
    with pytest.raises(ValueError, match="ground_truth is missing"):
        compute_score("#### 1", None)


def test_non_numeric_ground_truth_compares_as_text() -> None:
    assert compute_score("#### 72", "seventy-two") == 0.0
    assert compute_score("#### 72", "72 ") == 1.0


def test_format_credit_scorer_as_a_custom_fn() -> None:
    # reward.custom_fn is called verl-style, with keyword arguments
    def score(text: str) -> float:
        return score_with_format_credit(
            data_source="openai/gsm8k", solution_str=text, ground_truth="72", extra_info=None
        )

    assert FORMAT_CREDIT == 0.1
    assert score(COT + "#### 72") == 1.0
    assert score(COT + "#### 71") == 0.1  # the format, a wrong answer
    assert score(COT + "The answer is 72.") == 0.0  # the right number, not in the format
