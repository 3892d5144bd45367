"""The calculator recipe's data and scorer: arithmetic problems with exact answers, train and
test disjoint, in the RL prompt schema; the last number of the final answer scored exactly."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from megarl.rewards.arithmetic import compute_score
from megarl.rewards.registry import BUILTIN_SCORERS
from megarl.tools.data_prep.arithmetic import prepare, problems
from megarl.tools.data_prep.common import PrepareError

pytestmark = pytest.mark.unit


def test_problems_and_files(tmp_path):
    paths = prepare(tmp_path, "mixed", train_size=200, test_size=50)
    train, test = (pq.read_table(paths[s]).to_pylist() for s in ("train", "test"))
    assert len(train) == 200 and len(test) == 50
    questions = {r["prompt"][0]["content"] for r in train}
    assert len(questions) == 200 and not questions & {r["prompt"][0]["content"] for r in test}
    for row in train + test:
        question = row["prompt"][0]["content"]
        expression = question.removeprefix("What is ").removesuffix("?")
        assert int(row["reward_model"]["ground_truth"]) == eval(expression)
        assert row["data_source"] == "arithmetic"
    assert problems("add3", 5, seed=0) == problems("add3", 5, seed=0)
    with pytest.raises(PrepareError, match="unknown arithmetic kind"):
        problems("div", 1, 0)


def test_scorer():
    assert BUILTIN_SCORERS["arithmetic"] == "megarl.rewards.arithmetic:compute_score"
    assert compute_score("The answer is 1,458.", "1458") == 1.0
    assert compute_score("964 + 494 = 1458", "1458") == 1.0
    assert compute_score("It is 1458 or 1459", "1458") == 0.0  # the last number counts
    assert compute_score("-12", "-12") == 1.0
    assert compute_score("no idea", "3") == 0.0
    with pytest.raises(ValueError, match="ground_truth is missing"):
        compute_score("3", None)


def test_add2_rows_start_with_the_worked_examples_and_never_repeat_them(tmp_path):
    from megarl.rewards.arithmetic import score_answer
    from megarl.tools.data_prep.arithmetic import SHOTS, SPACE

    paths = prepare(tmp_path, "add2", train_size=300, test_size=128)
    train, test = (pq.read_table(paths[s]).to_pylist() for s in ("train", "test"))
    shots = [q for q, _ in SHOTS["add2"]]
    asked = [r["prompt"][-1]["content"] for r in train + test]
    assert len(set(asked)) == 428 and not set(asked) & set(shots)
    for row in train + test:
        *examples, question = row["prompt"]
        assert [m["role"] for m in examples] == ["user", "assistant"] * 2
        assert [m["content"] for m in examples[::2]] == shots
        a, b = map(int, question["content"].removeprefix("What is ").removesuffix("?").split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert row["reward_model"]["ground_truth"] == str(a + b)
        assert score_answer("arithmetic", examples[1]["content"], "37") == 1.0
    # every two-digit sum but the examples, then a clear error instead of an endless search
    assert len(problems("add2", SPACE["add2"], seed=3)) == 8098
    with pytest.raises(PrepareError, match="8098 distinct problems: ask for fewer"):
        problems("add2", 8000, seed=0, exclude={f"q{i}" for i in range(200)})
