"""scripts/prepare_sft.py: SFT rows in the schema SFTDataset reads, from GSM-Symbolic worked
solutions (offline) and from local files (conversations, prompt/response, preference pairs)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pyarrow.parquet as pq
import pytest

from megarl.data import SFTDataset
from tests.unit.test_data_sft_dataset import char_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prepare_sft.py"


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prepare_sft", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["prepare_sft"] = module
    spec.loader.exec_module(module)
    return module


def test_synthetic_gsm_rows_are_worked_solutions_the_dataset_reads(tmp_path):
    assert (
        script().main(
            [
                "--out",
                str(tmp_path),
                "--source",
                "synthetic-gsm",
                "--train-size",
                "6",
                "--test-size",
                "2",
            ]
        )
        == 0
    )
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(rows) == 6 and len(pq.read_table(tmp_path / "test.parquet")) == 2
    assert all(r["response"].rsplit("\n", 1)[-1].startswith("#### ") for r in rows)
    assert rows[0]["prompt"][0]["content"].endswith('like "#### 42".')
    ds = SFTDataset(
        str(tmp_path / "train.parquet"), char_tokenizer(), batch_size_per_rank=6, max_length=4096
    )
    [batch] = list(ds)
    assert all(it.trained_tokens == len(it.response_ids) for it in batch)


def test_local_files_of_each_format_and_bad_ones(tmp_path, capsys):
    records = [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    ]
    records += [
        {"prompt": "q", "response": "r"},
        {"prompt": "q", "chosen": "c", "rejected": "x"},
    ] * 2
    src = tmp_path / "rows.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in records))
    assert (
        script().main(["--out", str(tmp_path / "out"), "--source", str(src), "--test-size", "1"])
        == 0
    )
    rows = [
        *pq.read_table(tmp_path / "out" / "train.parquet").to_pylist(),
        *pq.read_table(tmp_path / "out" / "test.parquet").to_pylist(),
    ]
    replies = sorted(r["response"] if r.get("messages") is None else "messages" for r in rows)
    assert replies == ["c", "c", "messages", "r", "r"]
    ds = SFTDataset(
        str(tmp_path / "out" / "train.parquet"),
        char_tokenizer(),
        batch_size_per_rank=4,
        max_length=512,
    )
    assert len(next(iter(ds))) == 4  # the formats mixed in one file, row by row
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a"}))
    assert script().main(["--out", str(tmp_path / "bad"), "--source", str(bad)]) == 2
    assert "record 0 has neither 'messages' nor 'prompt'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script().main(["--out", str(tmp_path)])
