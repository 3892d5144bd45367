#!/usr/bin/env python
"""Write preference pairs (prompt/chosen/rejected) as DIR/train.parquet and DIR/test.parquet.

Sources:
  --source hh-rlhf        Anthropic/hh-rlhf from the hub (`datasets`, else `huggingface_hub`):
                          whole transcripts; the shared turns become the prompt, the final
                          assistant turns the chosen and rejected replies
  --source ultrafeedback  HuggingFaceH4/ultrafeedback_binarized (train_prefs / test_prefs)
  --source PATH           a local .parquet/.jsonl/.json file in either format (detected by its
                          columns: a 'prompt' column means ultrafeedback style), split into train
                          and test (--test-size rows, default 5%); or a folder of train*/test*
                          files
  --source synthetic-gsm  offline GSM-Symbolic pairs (reasoning-gym) that megarl.rewards.gsm8k
                          scores 1 (chosen) and 0 (rejected). Default: same worked reasoning and
                          length, the rejected final '#### N' off by 1-3. --easy: a short correct
                          answer against a non-answer ("I don't know.").

Each row: prompt=[{"role", "content"}, ...], chosen and rejected (reply strings), data_source,
ground_truth (the integer answer for synthetic-gsm, else null), extra_info={split, index, origin}.
--max-chars K keeps pairs whose prompt plus longer reply has at most K characters; --ascii-only
keeps printable-ASCII pairs (the character tokenizer of the tiny test models). Files are written
under a temporary name and renamed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq

from megarl.data.errors import DataError
from megarl.tools.data_prep.common import write_parquet_atomic
from megarl.tools.data_prep.preference_sources import (
    SOURCES,
    SYNTHETIC_SIZES,
    PairFilter,
    SplitResult,
    build_splits,
    describe_drops,
    pairs_table,
)


def prepare(
    out: Path,
    source: str,
    *,
    train_size: int | None = None,
    test_size: int | None = None,
    seed: int = 0,
    easy: bool = False,
    max_chars: int | None = None,
    ascii_only: bool = False,
    row_group_size: int = 512,
) -> dict[str, tuple[Path, SplitResult]]:
    """Write out/train.parquet and out/test.parquet; return each split's path and result."""
    if row_group_size < 1:
        raise DataError(f"--row-group-size must be >= 1, got {row_group_size}.")
    splits = build_splits(
        source,
        train_size=train_size,
        test_size=test_size,
        seed=seed,
        easy=easy,
        pair_filter=PairFilter(max_chars=max_chars, ascii_only=ascii_only),
    )
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, result in splits.items():
        path = out / f"{split}.parquet"
        write_parquet_atomic(pairs_table(result.pairs, split), path, row_group_size)
        written[split] = (path, result)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for train.parquet and test.parquet"
    )
    parser.add_argument("--source", required=True, help=f"{' | '.join(SOURCES)} | PATH")
    parser.add_argument(
        "--train-size",
        type=int,
        default=None,
        help=f"rows (default: all; synthetic-gsm {SYNTHETIC_SIZES['train']})",
    )
    parser.add_argument(
        "--test-size",
        type=int,
        default=None,
        help=f"rows (default: all; a single file 5%%; synthetic-gsm {SYNTHETIC_SIZES['test']})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--easy", action="store_true", help="synthetic-gsm: correct answer vs a non-answer"
    )
    parser.add_argument("--max-chars", type=int, default=None, help="drop pairs over K characters")
    parser.add_argument("--ascii-only", action="store_true", help="drop non-ASCII pairs")
    parser.add_argument("--row-group-size", type=int, default=512)
    args = parser.parse_args(argv)
    try:
        written = prepare(
            args.out,
            args.source,
            train_size=args.train_size,
            test_size=args.test_size,
            seed=args.seed,
            easy=args.easy,
            max_chars=args.max_chars,
            ascii_only=args.ascii_only,
            row_group_size=args.row_group_size,
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, (path, result) in written.items():
        meta = pq.ParquetFile(path)
        columns = ", ".join(meta.schema_arrow.names)
        print(f"{split}: {meta.metadata.num_rows} rows [{columns}] -> {path}")
        note = f"  {result.available} pairs available, dropped: {describe_drops(result.dropped)}"
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
