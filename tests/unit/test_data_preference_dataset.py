"""PreferenceDataset: pairs tokenised with the chat template, explicit truncation, same sharding."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data import DataError, PreferenceDataset
from tests.unit.test_data_files import qwen_tokenizer, tiny_tokenizer


def pair_rows(n: int, long_every: int = 0) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        extra = " x" * 40 if long_every and i % long_every == 0 else ""
        rows.append(
            {
                "prompt": f"question {i}",
                "chosen": f"{i}{extra}",
                "rejected": [{"role": "assistant", "content": f"hi {i}"}],
                "source": "synthetic",
            }
        )
    return rows


def write(folder: Path, rows: list[dict[str, Any]], group: int = 5, name: str = "pairs") -> str:
    path = folder / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=group)
    return str(path)


def make(
    files: str, rank: int = 0, dp: int = 1, tokenizer: Any = None, **kw: Any
) -> PreferenceDataset:
    options: dict[str, Any] = dict(batch_size_per_rank=3, max_length=32, seed=1, window_rows=6)
    options.update(kw)
    return PreferenceDataset(
        files, tokenizer or tiny_tokenizer(), dp_rank=rank, dp_size=dp, **options
    )


def test_pairs_are_prompt_plus_response_of_the_templated_conversation(tmp_path: Path) -> None:
    tok = qwen_tokenizer()
    rows = [
        {"prompt": "What is 6 * 7?", "chosen": "6 * 7 = 42\n#### 42", "rejected": "#### 41"},
        {
            "prompt": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "2+2?"},
            ],
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}],
        },
    ]
    # strings in one file, message lists in another (a column has one type per file)
    files = [write(tmp_path, [row], name=f"pairs-{i}") for i, row in enumerate(rows)]
    ds = make(files, tokenizer=tok, batch_size_per_rank=2, max_length=128, shuffle=False)
    (batch,) = list(ds)
    for item, row in zip(batch, rows, strict=True):
        prompt = (
            [{"role": "user", "content": row["prompt"]}]
            if isinstance(row["prompt"], str)
            else row["prompt"]
        )
        for side, ids in (("chosen", item.chosen_ids), ("rejected", item.rejected_ids)):
            reply = row[side] if isinstance(row[side], str) else row[side][0]["content"]
            conv = [*prompt, {"role": "assistant", "content": reply}]
            full = tok.apply_chat_template(conv, tokenize=False)
            assert tok.decode(item.prompt_ids + ids) == full
            assert tok.decode(ids) == f"{reply}<|im_end|>\n"
        assert tok.decode(item.prompt_ids).endswith("<|im_start|>assistant\n")
    assert batch[0].chosen_ids[-2:] == [151645, 198]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_sharding_and_resume_match_the_prompt_dataset(tmp_path: Path, dp: int) -> None:
    files = write(tmp_path, pair_rows(41), group=4)
    ranks = [make(files, r, dp, drop_last=False) for r in range(dp)]
    seen = Counter(item.uid for ds in ranks for batch in ds for item in batch)
    assert sorted(seen) == list(range(41)) and set(seen.values()) == {1}
    ds = make(files, dp - 1, dp)
    run = iter(ds)
    next(run)
    state = json.loads(json.dumps(ds.state_dict()))
    resumed = make(files, dp - 1, dp)
    resumed.load_state_dict(state)
    assert [[i.uid for i in b] for b in resumed] == [[i.uid for i in b] for b in run]


def test_overlong_pairs_error_names_the_row(tmp_path: Path) -> None:
    files = write(tmp_path, pair_rows(10, long_every=4))
    with pytest.raises(
        DataError,
        match=r"pairs\.parquet: row 0: the pair is 45 tokens \(prompt 4, chosen 41, rejected 2\), over max_length=32",
    ):
        list(make(files, batch_size_per_rank=10, shuffle=False))


def test_filter_drops_and_counts_overlong_pairs(tmp_path: Path) -> None:
    files = write(tmp_path, pair_rows(12, long_every=4))
    ds = make(files, batch_size_per_rank=3, truncation="filter", shuffle=False)
    kept = [i.uid for b in ds for i in b]
    assert kept == [
        1,
        2,
        3,
        5,
        6,
        7,
        9,
        10,
        11,
        1,
        2,
        3,
    ]  # three long pairs dropped; the last batch refilled
    assert ds.metrics()["data/filtered_pairs"] == 4.0 and ds.metrics()["data/refilled_pairs"] == 3.0


def test_truncate_cuts_responses_to_fit_and_drops_prompts_that_leave_no_room(
    tmp_path: Path,
) -> None:
    rows = pair_rows(6, long_every=3)
    rows[5]["prompt"] = "question" + " x" * 40
    files = write(tmp_path, rows)
    ds = make(files, batch_size_per_rank=5, truncation="truncate", shuffle=False, drop_last=False)
    batch, rest = list(ds)
    assert rest == [], "the last row leaves no room for a response: dropped"
    by_uid = {i.uid: i for i in batch}
    assert sorted(by_uid) == [0, 1, 2, 3, 4]
    for uid in (0, 3):
        item = by_uid[uid]
        assert item.truncated and len(item.prompt_ids) + len(item.chosen_ids) == 32
        assert len(item.rejected_ids) == 2, "the short response is left whole"
    assert not by_uid[1].truncated and by_uid[1].extra == {"source": "synthetic"}
    m = ds.metrics()
    assert m["data/truncated_pairs"] == 2.0 and m["data/filtered_pairs"] == 1.0


def test_missing_rejected_column_and_bad_policy(tmp_path: Path) -> None:
    rows = [{k: v for k, v in r.items() if k != "rejected"} for r in pair_rows(4)]
    files = write(tmp_path, rows)
    with pytest.raises(
        DataError, match=r"pairs\.parquet: missing column 'rejected'.*prompt, chosen and rejected"
    ):
        make(files)
    with pytest.raises(DataError, match="truncation must be 'error', 'filter' or 'truncate'"):
        make(write(tmp_path, pair_rows(4)), truncation="left")


def test_plain_text_pairs_without_template_end_in_eos(tmp_path: Path) -> None:
    rows = [{"prompt": "question 1", "chosen": "1", "rejected": "hi"}] * 3
    ds = make(write(tmp_path, rows), apply_chat_template=False, shuffle=False)
    item = next(iter(ds))[0]
    tok = tiny_tokenizer()
    assert tok.decode(item.prompt_ids) == "question 1"
    assert item.chosen_ids == [*tok("1", add_special_tokens=False)["input_ids"], tok.eos_token_id]


def test_dp2_rows_and_state_are_pinned(tmp_path: Path) -> None:
    """The exact pairs each DP2 rank reads (seed 1) and its resume state, as before the datasets
    shared one implementation."""
    files = write(tmp_path, pair_rows(30))
    pinned = {
        0: [[27, 11, 14], [26, 12, 25], [13, 28, 29]],
        1: [[19, 3, 18], [1, 17, 4], [2, 15, 16]],
    }
    for rank, first in pinned.items():
        ds = make(files, rank, 2)
        it = iter(ds)
        assert [[item.uid for item in next(it)] for _ in range(3)] == first
        state = ds.state_dict()
        assert (state["kind"], state["step"], state["cursor"], state["dp_rank"]) == (
            "preference",
            3,
            9,
            rank,
        )
        assert state["counters"] == {"dropped": 0, "refilled": 0, "truncated": 0}
