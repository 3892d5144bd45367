#!/usr/bin/env python
"""Write SFT rows as DIR/train.parquet and DIR/test.parquet for `megarl train-sft`.

Sources:
  --source synthetic-gsm  offline GSM-Symbolic problems (reasoning-gym): the question with the
                          GSM8K instruction as the prompt, the worked solution ending in
                          '#### N' as the response; train and test from disjoint templates
  --source PATH           a local .parquet/.jsonl/.json file of `messages` conversations or
                          `prompt` + `response` rows (a preference file's `chosen` counts as the
                          response), split into train and test (--test-size rows, default 5%)

Each row: prompt=[{"role", "content"}, ...] and response (a string), or messages; plus
extra_info={split, index, origin}. Files are written under a temporary name and renamed.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from megarl.data.errors import DataError
from megarl.tools.data_prep.common import (
    GSM8K_INSTRUCTION,
    PrepareError,
    iter_symbolic_problems,
    read_records,
    write_parquet_atomic,
)

SYNTHETIC_SIZES = {"train": 2048, "test": 128}


def synthetic_gsm(split: str, size: int, seed: int) -> list[dict[str, Any]]:
    rows = []
    for i, problem in enumerate(iter_symbolic_problems(seed, split, max_attempts=20 * size)):
        if i == size:
            break
        rows.append(
            {
                "prompt": [
                    {"role": "user", "content": f"{problem.question.strip()} {GSM8K_INSTRUCTION}"}
                ],
                "response": f"{problem.reasoning}\n#### {problem.answer}",
                "extra_info": {"split": split, "index": i, "origin": "gsm-symbolic"},
            }
        )
    if len(rows) < size:
        raise PrepareError(
            f"only {len(rows)} GSM-Symbolic {split} problems for --{split}-size {size}"
        )
    return rows


def _messages(value: Any, role: str) -> list[dict[str, str]]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


def local_rows(path: Path) -> list[dict[str, Any]]:
    """A local file's records as SFT rows (messages, or prompt + response/chosen)."""
    out = []
    for i, rec in enumerate(read_records(path)):
        where = f"{path}: record {i}"
        if rec.get("messages") is not None:
            out.append({"messages": _messages(rec["messages"], "user")})
            continue
        reply = rec.get("response", rec.get("chosen"))
        if rec.get("prompt") is None or reply is None:
            raise PrepareError(
                f"{where} has neither 'messages' nor 'prompt' with 'response' (or 'chosen'); "
                f"it has {sorted(rec)}"
            )
        response = reply if isinstance(reply, str) else _messages(reply, "assistant")[-1]["content"]
        out.append({"prompt": _messages(rec["prompt"], "user"), "response": response})
    return out


def prepare(
    out: Path, source: str, train_size: int | None, test_size: int | None, seed: int
) -> dict[str, int]:
    if source == "synthetic-gsm":
        splits = {
            split: synthetic_gsm(split, size or SYNTHETIC_SIZES[split], seed)
            for split, size in (("train", train_size), ("test", test_size))
        }
    else:
        path = Path(source)
        if not path.is_file():
            raise PrepareError(
                f"--source {source}: no such file; give 'synthetic-gsm' or a local file"
            )
        rows = local_rows(path)
        random.Random(seed).shuffle(rows)
        n_test = test_size if test_size is not None else max(1, len(rows) // 20)
        if not 0 < n_test < len(rows):
            raise PrepareError(
                f"--test-size {n_test} leaves no train or no test rows of {len(rows)}"
            )
        splits = {"test": rows[:n_test], "train": rows[n_test:][:train_size]}
        for split, part in splits.items():
            for i, row in enumerate(part):
                row["extra_info"] = {"split": split, "index": i, "origin": str(path)}
    out.mkdir(parents=True, exist_ok=True)
    for split, part in splits.items():
        names = ("messages", "prompt", "response", "extra_info")
        columns = [c for c in names if any(c in r for r in part)]
        # every row with every column: from_pylist would take the columns of the first row only
        table = pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in part])
        write_parquet_atomic(table, out / f"{split}.parquet", row_group_size=256)
    return {split: len(part) for split, part in splits.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--source", required=True, help="synthetic-gsm or a local file")
    parser.add_argument("--train-size", type=int, default=None)
    parser.add_argument("--test-size", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        sizes = prepare(args.out, args.source, args.train_size, args.test_size, args.seed)
    except DataError as e:
        print(f"prepare_sft: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {sizes['train']} train and {sizes['test']} test rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
