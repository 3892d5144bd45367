"""Arithmetic problems for the tool-use recipe ("What is 964 + 494?"), generated offline.

Each row follows the RL prompt schema with ``data_source`` ``arithmetic`` (scored by
:mod:`megarl.rewards.arithmetic`: the last number of the final answer against the exact value).
Train and test problems are drawn from separate seeds, and no test problem appears in train.
Kinds: ``add3`` (three-digit + three-digit), ``mul2`` (two-digit x two-digit), ``mixed`` (both,
and three-digit - three-digit), ``words`` (the same three operations as one-sentence word
problems: the model has to find the arithmetic in the text), ``add2`` (two-digit + two-digit,
answered without a tool after two worked examples: the learning benchmark's task).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from megarl.tools.data_prep.common import PrepareError, write_parquet_atomic

DATA_SOURCE = "arithmetic"


def _add3(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"What is {a} + {b}?", a + b


def _add2(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a} + {b}?", a + b


def _sub3(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"What is {a} - {b}?", a - b


def _mul2(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a} * {b}?", a * b


NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana")
# (sentence with {a}, {b}, {name}; the operation); a > b for subtractions
WORD_PROBLEMS = (
    ("{name} has {a} marbles and finds {b} more. How many marbles does {name} have now?", "+"),
    ("A train travels {a} km on Monday and {b} km on Tuesday. How many km is that in all?", "+"),
    ("A farm had {a} sheep and sold {b} of them. How many sheep are left?", "-"),
    ("{name} saved {a} dollars and spent {b} dollars on a bike. How many dollars are left?", "-"),
    ("There are {a} boxes with {b} pencils in each box. How many pencils are there?", "*"),
    ("A school orders {a} packs of {b} cookies each. How many cookies does it get?", "*"),
)


def _words(rng: random.Random) -> tuple[str, int]:
    text, op = rng.choice(WORD_PROBLEMS)
    if op == "*":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
    else:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if op == "-" and a < b:
            a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return text.format(a=a, b=b, name=rng.choice(NAMES)), value


KINDS: dict[str, list[Callable[[random.Random], tuple[str, int]]]] = {
    "add3": [_add3],
    "mul2": [_mul2],
    "mixed": [_add3, _sub3, _mul2],
    "words": [_words],
    "add2": [_add2],
}

# How many distinct problems a kind has, where that is small enough to run out of.
SPACE = {"add2": 90 * 90 - 2}  # less the two worked examples

# Worked examples put before every question of a kind as earlier chat turns. They show the form
# of an answer ("a + b = c", which SmolLM2-135M-Instruct then keeps: 12 tokens on average instead
# of 48 of rambling), so the reward measures the sums rather than the format. They are never a
# train or test problem.
SHOTS: dict[str, tuple[tuple[str, str], ...]] = {
    "add2": (("What is 23 + 14?", "23 + 14 = 37"), ("What is 48 + 35?", "48 + 35 = 83")),
}


def shot_messages(kind: str) -> list[dict[str, str]]:
    out = []
    for question, answer in SHOTS.get(kind, ()):
        out += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return out


def problems(
    kind: str, count: int, seed: int, exclude: set[str] | None = None
) -> list[tuple[str, int]]:
    if kind not in KINDS:
        raise PrepareError(f"unknown arithmetic kind {kind!r}; known: {sorted(KINDS)}")
    if kind in SPACE and count + len(exclude or ()) > SPACE[kind]:
        raise PrepareError(
            f"{count} {kind} problems asked for (plus {len(exclude or ())} excluded), but the kind "
            f"has {SPACE[kind]} distinct problems: ask for fewer"
        )
    rng = random.Random(f"arithmetic/{kind}/{seed}")
    seen = set(exclude or ()) | {question for question, _ in SHOTS.get(kind, ())}
    out: list[tuple[str, int]] = []
    while len(out) < count:
        question, answer = rng.choice(KINDS[kind])(rng)
        if question not in seen:
            seen.add(question)
            out.append((question, answer))
    return out


def make_row(
    question: str, answer: int, split: str, index: int, shots: list[dict[str, str]] | None = None
) -> dict[str, object]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [*(shots or []), {"role": "user", "content": question}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index},
    }


def prepare(
    out: Path, kind: str, train_size: int, test_size: int, seed: int = 0
) -> dict[str, Path]:
    """Write out/train.parquet and out/test.parquet; return their paths."""
    if train_size < 1 or test_size < 1:
        raise PrepareError("train and test sizes must be >= 1")
    test = problems(kind, test_size, seed + 1)
    train = problems(kind, train_size, seed, exclude={q for q, _ in test})
    out.mkdir(parents=True, exist_ok=True)
    paths, shots = {}, shot_messages(kind)
    for split, rows in (("train", train), ("test", test)):
        paths[split] = out / f"{split}.parquet"
        table = pa.Table.from_pylist(
            [make_row(q, a, split, i, shots) for i, (q, a) in enumerate(rows)]
        )
        write_parquet_atomic(table, paths[split], 512)
    return paths
