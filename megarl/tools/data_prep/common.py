"""Helpers shared by the data preparation scripts (scripts/prepare_*.py).

- reading a local table of records (.parquet, .jsonl, .json, each optionally .gz) and writing a
  parquet file atomically (a hidden temporary file renamed into place);
- a seeded subsample that keeps the source's order;
- GSM-Symbolic problems generated offline with `reasoning-gym` (GSM8K-derived templates with
  integer answers; every fifth template is held out for the test split).

`iter_symbolic_problems(seed, split)` yields the same problems, in the same order, as
scripts/prepare_gsm8k.py's `--source gsm-symbolic` (a unit test pins that), so both scripts can
share it.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.data.errors import DataError
from megarl.files import temporary_beside

T = TypeVar("T")

GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = (
    'Work it out step by step, then give the final answer as a number after "####", like "#### 42".'
)
RECORD_SUFFIXES = (".parquet", ".jsonl", ".json", ".jsonl.gz", ".json.gz")
_FINAL_LINE = re.compile(r"\n?####\s*(-?[\d,]+)\s*$")


class PrepareError(DataError):
    """A problem with the source data or the options of a preparation script; the message says
    how to fix it."""


def has_record_suffix(path: Path) -> bool:
    return path.name.endswith(RECORD_SUFFIXES)


def _open_text(path: Path) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _json_lines(path: Path, text: str) -> list[dict[str, object]]:
    records = []
    # Split on "\n" only: str.splitlines also breaks at U+2028/U+2029/U+0085, which JSON strings
    # may hold unescaped.
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise PrepareError(f"{path}: line {n} is not JSON ({e}).") from e
    return records


def read_records(path: Path) -> list[dict[str, object]]:
    """The rows of a .parquet, .jsonl or .json file (optionally gzipped) as dicts.

    A .json file may hold one JSON list of objects or JSON lines (what `datasets`' to_json
    writes); every record must be a JSON object.
    """
    if not has_record_suffix(path):
        raise PrepareError(
            f"{path}: unsupported file type; give a {', '.join(RECORD_SUFFIXES)} file."
        )
    if path.suffix == ".parquet":
        try:
            records: list[Any] = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise PrepareError(f"{path}: not a readable parquet file ({e}).") from e
    else:
        try:
            with _open_text(path) as f:
                text = f.read()
        except (OSError, UnicodeDecodeError, EOFError) as e:
            raise PrepareError(f"{path}: cannot read it as UTF-8 text ({e}).") from e
        records = []
        if ".jsonl" not in path.name:
            try:
                whole = json.loads(text)
            except json.JSONDecodeError:
                records = _json_lines(path, text)
            else:
                records = whole if isinstance(whole, list) else [whole]
        else:
            records = _json_lines(path, text)
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise PrepareError(
                f"{path}: record {i} is {type(rec).__name__}, not an object with named columns."
            )
    return records


def write_parquet_atomic(table: pa.Table, path: Path, row_group_size: int) -> None:
    """Write `table` to `path` through a hidden temporary file in the same folder, then rename,
    so a reader never sees a half-written file."""
    with temporary_beside(path) as (f, tmp):
        pq.write_table(table, f, row_group_size=row_group_size)
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def subsample(items: Sequence[T], n: int | None, seed: int, split: str) -> list[T]:
    """`n` items drawn with a seeded RNG, in their original order (all of them when n is None or
    at least their number)."""
    if n is None or n >= len(items):
        return list(items)
    keep = sorted(random.Random(f"{seed}/{split}").sample(range(len(items)), n))
    return [items[i] for i in keep]


@dataclass(frozen=True)
class SymbolicProblem:
    """One generated GSM-Symbolic problem with its worked solution ending in '#### <answer>'."""

    question: str
    solution: str
    answer: int
    template: int
    attempt: int

    @property
    def reasoning(self) -> str:
        """The worked solution without its final '#### <answer>' line."""
        return _FINAL_LINE.sub("", self.solution.rstrip()).rstrip()


def symbolic_templates(split: str) -> list[int]:
    """Every fifth usable GSM-Symbolic template is a test template; the rest are for training."""
    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import tasks_ok

    ordered = sorted(tasks_ok)
    return [t for i, t in enumerate(ordered) if (i % 5 == 4) == (split == "test")]


def iter_symbolic_problems(seed: int, split: str, max_attempts: int) -> Iterator[SymbolicProblem]:
    """GSM-Symbolic problems with integer answers, cycling over the split's templates, each
    attempt seeded on its own; stops after `max_attempts` attempts."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise PrepareError(
            "GSM-Symbolic problems need `reasoning-gym` (pip install reasoning-gym==0.1.25)."
        ) from e
    generators = reasoning_gym.create_dataset("gsm_symbolic", size=1, seed=seed).generators
    templates = symbolic_templates(split)
    for attempt in range(max_attempts):
        rng = random.Random(f"gsm-symbolic/{seed}/{split}/{attempt}")
        template = templates[attempt % len(templates)]
        example = generators[template](rng, 1.0)
        value = example["metadata"]["answer_value"]
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            continue  # integer answers only, as GSM8K has
        yield SymbolicProblem(
            question=example["question"],
            solution=example["metadata"]["answer_cot"],
            answer=value,
            template=template,
            attempt=attempt,
        )
