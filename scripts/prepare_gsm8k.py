#!/usr/bin/env python
"""Write GSM8K as RL parquet (verl's schema): DIR/train.parquet and DIR/test.parquet.

Sources:
  --source hub            the real GSM8K through Hugging Face `datasets` (needs a reachable hub)
  --source PATH           a local copy of GSM8K: a folder holding train*.jsonl|parquet and
                          test*.jsonl|parquet with `question` and `answer` columns (the layout
                          of the original release and of the hub's parquet export)
  --source gsm-symbolic   GSM-Symbolic problems generated offline with `reasoning-gym`: templates
                          derived from GSM8K with integer answers; train and test use disjoint
                          templates, so test problems are not re-worded training problems

Each row: data_source="openai/gsm8k", prompt=[{"role": "user", "content": question +
instruction to answer after "####"}], ability="math", reward_model={"style": "rule",
"ground_truth": "<integer>"} (a string, as verl writes it), extra_info={split, index, question,
answer, origin}. Row groups are small (--row-group-size) so data-parallel ranks read only theirs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.tools.data_prep.common import (
    GSM8K_DATA_SOURCE,
    GSM8K_INSTRUCTION,
    PrepareError,
    iter_symbolic_problems,
    read_records,
    subsample,
    write_parquet_atomic,
)

GSM8K_SIZES = {"train": 7473, "test": 1319}
_FINAL = re.compile(r"####\s*(-?[\d,]+)\s*$")


def final_answer(answer_text: str, where: str) -> str:
    """GSM8K's integer after the last '####' of a worked answer, without thousands separators."""
    m = _FINAL.search(answer_text.strip())
    if m is None:
        raise PrepareError(
            f"{where}: column 'answer' does not end in '#### <integer>': {answer_text[-80:]!r}"
        )
    return str(int(m.group(1).replace(",", "")))


def make_row(
    question: str, answer_text: str, truth: str, split: str, index: int, origin: str
) -> dict[str, Any]:
    return {
        "data_source": GSM8K_DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question.strip()} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {
            "split": split,
            "index": index,
            "question": question,
            "answer": answer_text,
            "origin": origin,
        },
    }


def _rows_from_records(
    records: Sequence[dict[str, Any]], split: str, where: str
) -> list[dict[str, Any]]:
    rows = []
    for i, rec in enumerate(records):
        for col in ("question", "answer"):
            if not isinstance(rec.get(col), str):
                raise PrepareError(
                    f"{where}: record {i} has no string column '{col}' (GSM8K has question, answer)."
                )
        truth = final_answer(rec["answer"], f"{where}: record {i}")
        rows.append(make_row(rec["question"], rec["answer"], truth, split, i, "gsm8k"))
    return rows


def _read_records(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return read_records(path)
    # JSON lines are read here, not by read_records: that splits with str.splitlines, which also
    # breaks at U+2028/U+2029/U+0085, characters a JSON string may hold unescaped.
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise PrepareError(f"{path}: line {n} is not JSON ({e}).") from e
    return records


def load_local(root: Path) -> dict[str, list[dict[str, Any]]]:
    if not root.exists():
        raise PrepareError(
            f"--source {root}: no such file or folder; give a GSM8K folder, 'hub' or 'gsm-symbolic'."
        )
    files = sorted(
        p
        for p in ([root] if root.is_file() else root.rglob("*"))
        if p.suffix in (".jsonl", ".parquet")
    )
    out = {}
    for split in ("train", "test"):
        matches = [p for p in files if p.name.startswith(split)]
        if len(matches) != 1:
            raise PrepareError(
                f"--source {root}: expected one {split}*.jsonl or {split}*.parquet file, found "
                f"{[str(p) for p in matches] or 'none'}."
            )
        out[split] = _rows_from_records(_read_records(matches[0]), split, str(matches[0]))
    return out


def load_hub() -> dict[str, list[dict[str, Any]]]:
    try:
        import datasets
    except ImportError as e:
        raise PrepareError(
            "--source hub needs the `datasets` package (pip install datasets); without a hub, "
            "pass a local GSM8K folder or --source gsm-symbolic."
        ) from e
    try:
        ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as e:
        raise PrepareError(
            f"--source hub: could not load openai/gsm8k ({type(e).__name__}: {e}); without a hub, "
            "pass a local GSM8K folder or --source gsm-symbolic."
        ) from e
    return {
        split: _rows_from_records(list(ds[split]), split, f"hub openai/gsm8k[{split}]")
        for split in ("train", "test")
    }


def generate_symbolic(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """`n` GSM-Symbolic rows: the first `n` integer-answer problems of the split's templates."""
    try:
        import reasoning_gym  # noqa: F401  (this script's own message if it is missing)
    except ImportError as e:
        raise PrepareError(
            "--source gsm-symbolic needs `reasoning-gym` (pip install reasoning-gym==0.1.25)."
        ) from e
    problems = iter_symbolic_problems(seed, split, max_attempts=10 * n + 100)
    rows = [
        make_row(p.question, p.solution, str(p.answer), split, i, f"gsm-symbolic/{p.template}")
        for i, p in enumerate(itertools.islice(problems, n))
    ]
    if len(rows) < n:
        raise PrepareError(f"gsm-symbolic: could not generate {n} integer-answer problems.")
    return rows


def _subsample_split(
    rows: list[dict[str, Any]], n: int | None, seed: int, split: str
) -> list[dict[str, Any]]:
    if n is not None and n > len(rows):
        print(
            f"note: {split} has {len(rows)} rows; --{split}-size {n} keeps them all",
            file=sys.stderr,
        )
    return subsample(rows, n, seed, split)


def prepare(
    out: Path,
    source: str = "hub",
    *,
    train_size: int | None = None,
    test_size: int | None = None,
    seed: int = 0,
    row_group_size: int = 512,
    data_source: str = GSM8K_DATA_SOURCE,
) -> dict[str, Path]:
    """Write out/train.parquet and out/test.parquet; return their paths. `data_source` names the
    rows' task (reward routing and validation metric names): a toy reward over these prompts
    should not report itself as GSM8K."""
    for name, value in (
        ("train-size", train_size),
        ("test-size", test_size),
        ("row-group-size", row_group_size),
    ):
        if value is not None and value < 1:
            raise PrepareError(f"--{name} must be >= 1, got {value}.")
    if source == "gsm-symbolic":
        splits = {
            split: generate_symbolic(size or GSM8K_SIZES[split], seed, split)
            for split, size in (("train", train_size), ("test", test_size))
        }
    else:
        loaded = load_hub() if source == "hub" else load_local(Path(source))
        splits = {
            "train": _subsample_split(loaded["train"], train_size, seed, "train"),
            "test": _subsample_split(loaded["test"], test_size, seed, "test"),
        }
    if not data_source:
        raise PrepareError("--data-source must not be empty.")
    for rows in splits.values():
        for row in rows:
            row["data_source"] = data_source
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        paths[split] = out / f"{split}.parquet"
        write_parquet_atomic(pa.Table.from_pylist(rows), paths[split], row_group_size)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for train.parquet and test.parquet"
    )
    parser.add_argument(
        "--source", default="hub", help="hub | PATH to a local GSM8K | gsm-symbolic"
    )
    parser.add_argument(
        "--train-size", type=int, default=None, help="rows (default: all; gsm-symbolic 7473)"
    )
    parser.add_argument(
        "--test-size", type=int, default=None, help="rows (default: all; gsm-symbolic 1319)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--row-group-size", type=int, default=512)
    parser.add_argument(
        "--data-source",
        default=GSM8K_DATA_SOURCE,
        help=f"the rows' data_source (rewards route by it; default {GSM8K_DATA_SOURCE})",
    )
    args = parser.parse_args(argv)
    try:
        paths = prepare(
            args.out,
            args.source,
            train_size=args.train_size,
            test_size=args.test_size,
            seed=args.seed,
            row_group_size=args.row_group_size,
            data_source=args.data_source,
        )
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, path in paths.items():
        print(f"{split}: {pq.ParquetFile(path).metadata.num_rows} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
