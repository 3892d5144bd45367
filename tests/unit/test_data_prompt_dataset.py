"""PromptDataset over several files with uneven row groups, for 1-4 data-parallel ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from megarl.data import DataError, PromptDataset, PromptItem
from tests.unit.test_data_files import (
    CountingHandler,
    prompt_rows,
    tiny_tokenizer,
    write_prompt_files,
)

LAYOUT = [(37, 10), (23, 7), (41, 16), (9, 9)]  # 110 rows; every file's last row group is short
N = sum(rows for rows, _ in LAYOUT)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("prompts")
    write_prompt_files(folder, LAYOUT)
    return str(folder / "part-*.parquet")


def make(files: str, rank: int = 0, dp: int = 1, **kw: Any) -> PromptDataset:
    options: dict[str, Any] = dict(
        batch_size_per_rank=4, max_prompt_length=64, seed=5, window_rows=16
    )
    options.update(kw)
    return PromptDataset(files, tiny_tokenizer(), dp_rank=rank, dp_size=dp, **options)


def batches_until(ds: PromptDataset, epoch: int) -> Iterator[list[PromptItem]]:
    while ds.epoch < epoch:
        yield from ds


def uids(batches: list[list[PromptItem]]) -> list[list[int]]:
    return [[item.uid for item in b] for b in batches]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_every_epoch_is_split_disjointly_and_evenly(files: str, dp: int) -> None:
    ranks = [make(files, r, dp, drop_last=False) for r in range(dp)]
    assert len({ds.steps_per_epoch for ds in ranks}) == 1
    for epoch in range(2):
        seen = [[item for batch in ds for item in batch] for ds in ranks]
        counts = Counter(item.uid for items in seen for item in items)
        assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}, f"epoch {epoch}"
        sizes = [len(items) for items in seen]
        assert max(sizes) - min(sizes) <= 1
        for item in (i for items in seen for i in items):
            # the uid is the row's index in the dataset: the content says which row it is
            assert item.prompt == [{"role": "user", "content": f"question {item.uid}"}]
            assert item.ground_truth == str(item.uid) and item.extra_info == {"index": item.uid}
            assert item.data_source == "openai/gsm8k" and item.extra == {"ability": "math"}
        assert all(ds.epoch == epoch + 1 for ds in ranks)


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_drop_last_gives_every_rank_the_same_number_of_full_batches(files: str, dp: int) -> None:
    ranks = [make(files, r, dp, batch_size_per_rank=3) for r in range(dp)]
    steps = ranks[0].steps_per_epoch
    assert steps == (N // dp) // 3
    per_rank = [list(ds) for ds in ranks]
    assert all(len(b) == steps and all(len(x) == 3 for x in b) for b in per_rank)
    flat = [u for batches in per_rank for batch in uids(batches) for u in batch]
    assert len(flat) == len(set(flat)), "ranks never share a prompt"
    assert len(flat) >= N - dp * 3, "each rank leaves fewer than one batch of its share unused"


def test_same_seed_same_batches_other_seed_or_epoch_other_order(files: str) -> None:
    first = uids(list(make(files, 1, 3)))
    assert first == uids(list(make(files, 1, 3)))
    assert first != uids(list(make(files, 1, 3, seed=6)))
    ds = make(files, 1, 3)
    list(ds)
    assert first != uids(list(ds)), "the next epoch reshuffles"
    unshuffled = [u for b in uids(list(make(files, 0, 1, shuffle=False))) for u in b]
    assert unshuffled == list(range(len(unshuffled)))


@pytest.mark.parametrize(("dp", "k"), [(1, 3), (2, 0), (3, 5), (4, 2), (4, 6)])
def test_state_after_k_batches_restores_exactly_the_remaining_batches(
    files: str, dp: int, k: int
) -> None:
    for rank in range(dp):
        ds = make(files, rank, dp)
        run = batches_until(ds, 3)
        head = [next(run) for _ in range(k)]
        saved = json.dumps(ds.state_dict())  # plain JSON
        rest = list(run)
        assert len(head) + len(rest) == 3 * ds.steps_per_epoch

        resumed = make(files, rank, dp)
        resumed.load_state_dict(json.loads(saved))
        again = list(batches_until(resumed, 3))
        assert uids(again) == uids(rest)
        assert [[i.input_ids for i in b] for b in again] == [[i.input_ids for i in b] for b in rest]


def test_state_restores_in_a_fresh_process(files: str, tmp_path: Path) -> None:
    ds = make(files, 1, 2)
    run = batches_until(ds, 2)
    for _ in range(ds.steps_per_epoch + 2):  # into the second epoch
        next(run)
    state = tmp_path / "data_state.json"
    state.write_text(json.dumps(ds.state_dict()))
    expected = uids(list(run))
    script = textwrap.dedent(
        f"""
        import json
        from megarl.data import PromptDataset
        from tests.unit.test_data_files import tiny_tokenizer
        ds = PromptDataset({files!r}, tiny_tokenizer(), batch_size_per_rank=4, max_prompt_length=64,
                           seed=5, window_rows=16, dp_rank=1, dp_size=2)
        ds.load_state_dict(json.loads(open({str(state)!r}).read()))
        out = []
        while ds.epoch < 2:
            out += [[i.uid for i in b] for b in ds]
        print(json.dumps(out))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected


def test_each_rank_reads_about_its_share_of_the_bytes(tmp_path: Path) -> None:
    """4 ranks over 4 files of 12 row groups each: a rank reads ~1/4 of the bytes, not everything."""
    write_prompt_files(tmp_path, [(600, 50)] * 4, extra=2000)
    pattern = str(tmp_path / "*.parquet")
    everything = CountingHandler()
    for path in sorted(tmp_path.glob("*.parquet")):
        pq.read_table(str(path), filesystem=pafs.PyFileSystem(everything))
    total = everything.total()
    for rank in range(4):
        counting = CountingHandler()
        ds = PromptDataset(
            pattern,
            tiny_tokenizer(),
            batch_size_per_rank=50,
            max_prompt_length=64,
            dp_rank=rank,
            dp_size=4,
            filesystem=pafs.PyFileSystem(counting),
            window_rows=100,
        )
        served = sum(len(b) for b in ds)
        assert served == 600
        share = counting.total() / total
        # its quarter, plus at most two partly used row groups (1/48 of the data each) and footers
        assert 0.24 < share < 0.25 + 2 / 48 + 0.03, f"rank {rank} read {share:.1%} of the bytes"


def test_overlong_prompt_error_names_file_row_and_fix(tmp_path: Path) -> None:
    rows = prompt_rows(0, 20)
    rows[13]["prompt"][0]["content"] += " x" * 80
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=5)
    ds = make(str(tmp_path / "a.parquet"), batch_size_per_rank=20, shuffle=False)
    with pytest.raises(
        DataError,
        match=r"a\.parquet: row 13: the prompt is 84 tokens .* over max_prompt_length=64.*overlong_prompts='filter'",
    ):
        list(ds)


def test_filtered_prompts_are_counted_and_ranks_stay_in_lockstep(tmp_path: Path) -> None:
    rows = prompt_rows(0, 60)
    for r in rows[::2]:
        r["prompt"][0]["content"] += " x" * 80  # every second prompt is too long
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=7)
    files = str(tmp_path / "a.parquet")
    ranks = [make(files, r, 3, overlong_prompts="filter") for r in range(3)]
    out = [list(ds) for ds in ranks]
    assert [len(b) for b in out] == [ranks[0].steps_per_epoch] * 3 == [5] * 3
    for ds, batches in zip(ranks, out, strict=True):
        assert all(len(b) == 4 and all(i.uid % 2 == 1 for i in b) for b in batches)
        m = ds.metrics()
        assert (
            m["data/filtered_overlong_prompts"] >= 10
        )  # the long half of its 20-row share, at least
        assert m["data/refilled_prompts"] == 10  # 10 short prompts in its share, 20 needed
        ids = [i.uid for b in batches for i in b]
        assert len(set(ids)) == 10 and all(c == 2 for c in Counter(ids).values())
    # resuming in the refill phase (cursor past the share) replays the same batches
    ds = make(files, 2, 3, overlong_prompts="filter")
    run = iter(ds)
    for _ in range(4):
        next(run)
    resumed = make(files, 2, 3, overlong_prompts="filter")
    resumed.load_state_dict(json.loads(json.dumps(ds.state_dict())))
    assert uids(list(resumed)) == uids(list(run)) == uids(out[2][4:])


def test_when_every_prompt_is_dropped_the_error_says_so(tmp_path: Path) -> None:
    rows = prompt_rows(0, 12, pad=80)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    with pytest.raises(DataError, match="every row of data-parallel rank 0's share"):
        list(make(str(tmp_path / "a.parquet"), overlong_prompts="filter"))


def test_too_few_rows_for_the_layout_is_refused(files: str) -> None:
    with pytest.raises(DataError, match=r"too few for 4 data-parallel ranks x 64 rows per batch"):
        make(files, 0, 4, batch_size_per_rank=64)


def test_states_that_cannot_replay_are_refused(files: str, tmp_path: Path) -> None:
    ds = make(files, 0, 2)
    next(iter(ds))
    mid = ds.state_dict()
    with pytest.raises(
        DataError,
        match=r"mid-epoch under another layout \(dp_size saved 2, now 3, dp_rank saved 0, now 1|dp_rank",
    ):
        make(files, 1, 3).load_state_dict(mid)
    with pytest.raises(DataError, match="batch_size_per_rank saved 4, now 2"):
        make(files, 0, 2, batch_size_per_rank=2).load_state_dict(mid)
    other = tmp_path / "other"
    other.mkdir()
    write_prompt_files(other, [(50, 10)])
    with pytest.raises(DataError, match="saved over other data"):
        make(str(other / "*.parquet"), 0, 2).load_state_dict(mid)
    with pytest.raises(DataError, match="expected a dict with format"):
        make(files, 0, 2).load_state_dict({"epoch": 1})
    broken = {**mid, "cursor": -3}
    with pytest.raises(DataError, match=r"\['cursor'\] must be non-negative"):
        make(files, 0, 2).load_state_dict(broken)


def test_an_epoch_boundary_state_resumes_under_a_new_layout(files: str) -> None:
    ds = make(files, 0, 2)
    list(ds)
    boundary = ds.state_dict()
    assert boundary["epoch"] == 1 and boundary["step"] == 0 and boundary["cursor"] == 0
    grown = [make(files, r, 4, seed=99) for r in range(4)]
    for g in grown:
        g.load_state_dict(boundary)
    assert all(g.epoch == 1 for g in grown)
    fresh = [make(files, r, 4) for r in range(4)]  # seed 5, as saved
    for f in fresh:
        list(f)
    assert [uids(list(g)) for g in grown] == [uids(list(f)) for f in fresh], "the saved seed wins"


def test_loading_state_under_a_live_iterator_is_refused(files: str) -> None:
    ds = make(files)
    run = iter(ds)
    next(run)
    ds.load_state_dict(ds.state_dict())
    with pytest.raises(RuntimeError, match="load_state_dict"):
        next(run)


def test_null_cells_are_named(tmp_path: Path) -> None:
    rows = prompt_rows(0, 6)
    rows[4]["prompt"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"a\.parquet: row 4: column 'prompt' is empty"):
        list(make(str(tmp_path / "a.parquet"), batch_size_per_rank=6, shuffle=False))


def test_plain_string_prompts_with_and_without_template(tmp_path: Path) -> None:
    rows = [
        {"prompt": f"question {i}", "data_source": "d", "reward_model": {"ground_truth": "1"}}
        for i in range(4)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    tok = tiny_tokenizer()
    templated = next(iter(make(str(tmp_path / "a.parquet"), shuffle=False)))
    assert tok.decode(templated[2].input_ids) == "<|user|> question 2 <|assistant|>"
    raw = next(iter(make(str(tmp_path / "a.parquet"), shuffle=False, apply_chat_template=False)))
    assert tok.decode(raw[2].input_ids) == "question 2"
    assert raw[2].prompt == "question 2" and raw[2].extra_info is None


def test_extra_columns_limits_what_is_read_and_passed_through(tmp_path: Path) -> None:
    write_prompt_files(tmp_path, [(200, 50)], extra=2000)
    pattern = str(tmp_path / "*.parquet")
    read = {}
    for name, extra in (("all", None), ("none", []), ("ability", ["ability"])):
        counting = CountingHandler()
        ds = make(pattern, extra_columns=extra, filesystem=pafs.PyFileSystem(counting))
        items = [i for batch in ds for i in batch]  # a whole epoch is read
        item = items[0]
        read[name] = counting.total()
        assert (
            set(item.extra)
            == {"all": {"ability", "document"}, "none": set(), "ability": {"ability"}}[name]
        )
    assert read["none"] < read["all"] / 4, "the bulky 'document' column is not read at all"
    with pytest.raises(DataError, match=r"part-000\.parquet: missing column 'notes'"):
        make(pattern, extra_columns=["notes"])


def test_dp2_rows_and_resume_state_are_pinned(files: str) -> None:
    """The exact rows each DP2 rank reads (seed 5) before and after a resume, and the resume
    state's fields, as the dataset gave them before the datasets shared one implementation."""
    pinned = {
        0: ([[64, 60, 44, 46], [63, 67, 72, 66], [69, 74, 45, 65]], [70, 68, 73, 62]),
        1: ([[27, 91, 82, 89], [28, 84, 90, 87], [42, 76, 40, 38]], [43, 79, 85, 80]),
    }
    second_epoch = {0: [62, 67, 71, 63], 1: [5, 46, 28, 3]}
    for rank, (first, after) in pinned.items():
        ds = make(files, rank, 2)
        it = iter(ds)
        assert uids([next(it) for _ in range(3)]) == first
        state = ds.state_dict()
        assert {k: v for k, v in state.items() if k != "fingerprint"} == {
            "format": "megarl.data.state/1",
            "kind": "prompt",
            "seed": 5,
            "epoch": 0,
            "step": 3,
            "cursor": 12,
            "dp_rank": rank,
            "dp_size": 2,
            "batch_size_per_rank": 4,
            "counters": {"dropped": 0, "refilled": 0},
        }
        resumed = make(files, rank, 2)
        resumed.load_state_dict(state)
        assert uids([next(iter(resumed))]) == uids([next(it)]) == [after]
        for _ in it:
            pass
        assert uids([next(iter(ds))]) == [second_epoch[rank]]


def test_reading_prompts_leaves_pandas_out(files: str) -> None:
    """Arrow's array constructor imports pandas to ask whether its input is a pandas object;
    the reader takes its rows without it (megarl never uses pandas)."""
    script = textwrap.dedent(
        f"""
        import sys
        from megarl.data import PromptDataset
        from tests.unit.test_data_files import tiny_tokenizer
        ds = PromptDataset({files!r}, tiny_tokenizer(), batch_size_per_rank=4, max_prompt_length=64,
                           seed=5, window_rows=16, dp_rank=0, dp_size=1)
        rows = sum(len(b) for b in ds)
        print(rows, "pandas" in sys.modules)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(N - N % 4), "False"]
