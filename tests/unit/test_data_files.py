"""File listing, footers and schema checks: every bad input names the file, the column and the fix.

Also home of the helpers the other data tests build their parquet sets with.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from megarl.data import DataError, PromptDataset
from megarl.data.parquet_source import fingerprint, inspect_files, resolve_files
from megarl.errors import MegarlError


def prompt_rows(start: int, n: int, *, pad: int = 0) -> list[dict[str, Any]]:
    """verl-schema rows whose uid is recoverable from the content ('question <global index>')."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"question {i}" + " x" * pad}],
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i},
            "ability": "math",
        }
        for i in range(start, start + n)
    ]


def write_prompt_files(
    folder: Path, layout: Sequence[tuple[int, int]], *, pad: int = 0, extra: int = 0
) -> list[Path]:
    """One file per (rows, row_group_size), named so that sorted order is layout order.

    `extra` adds a pass-through text column of that many characters per row (bulk for I/O tests).
    """
    paths, start = [], 0
    for i, (rows, group) in enumerate(layout):
        table = pa.Table.from_pylist(prompt_rows(start, rows, pad=pad))
        if extra:
            table = table.append_column(
                "document", pa.array([os.urandom(extra // 2).hex() for _ in range(rows)])
            )
        path = folder / f"part-{i:03d}.parquet"
        pq.write_table(table, path, row_group_size=group)
        paths.append(path)
        start += rows
    return paths


@functools.cache
def qwen_tokenizer() -> Any:
    """The real Qwen2.5 tokenizer (ChatML), loaded once per test process."""
    from transformers import AutoTokenizer

    from tests.assets import qwen25_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen25_tokenizer_dir())


@functools.cache
def tiny_tokenizer() -> Any:
    """A word-level tokenizer with a chat template: fast to build, for tests about sharding, not text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [
        "<unk>",
        "<eos>",
        "<|user|>",
        "<|assistant|>",
        "question",
        "x",
        "hi",
        *map(str, range(1000)),
    ]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    tok.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    return tok


class CountingHandler(pafs.FileSystemHandler):
    """A local filesystem that counts the bytes read from each file (through pyarrow's PyFileSystem)."""

    def __init__(self) -> None:
        self.fs = pafs.LocalFileSystem()
        self.bytes_read: dict[str, int] = {}

    def open_input_file(self, path: str) -> pa.PythonFile:
        handler = self

        class Counted:
            def __init__(self) -> None:
                self.f = open(path, "rb")  # noqa: SIM115 (closed through pyarrow's close)
                self.closed = False

            def read(self, n: int = -1) -> bytes:
                data = self.f.read(n)
                handler.bytes_read[path] = handler.bytes_read.get(path, 0) + len(data)
                return data

            def seek(self, pos: int, whence: int = 0) -> int:
                return self.f.seek(pos, whence)

            def tell(self) -> int:
                return self.f.tell()

            def close(self) -> None:
                self.closed = True
                self.f.close()

            def readable(self) -> bool:
                return True

            def seekable(self) -> bool:
                return True

            def writable(self) -> bool:
                return False

        return pa.PythonFile(Counted(), mode="r")

    def total(self) -> int:
        return sum(self.bytes_read.values())

    # Everything else delegates to the local filesystem.
    def get_type_name(self) -> str:
        return "counting-local"

    def equals(self, other: Any) -> bool:
        return other is self

    def normalize_path(self, path: str) -> str:
        return path

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.fs.get_file_info(selector)

    def open_input_stream(self, path: str) -> Any:
        return self.open_input_file(path)

    def create_dir(self, path: str, recursive: bool) -> None:
        raise NotImplementedError

    delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = create_dir  # type: ignore[assignment]
    move = copy_file = open_output_stream = open_append_stream = create_dir  # type: ignore[assignment]


# ---- file listing ----------------------------------------------------------------------------


def test_globs_folders_and_lists_resolve_sorted_and_deduplicated(tmp_path: Path) -> None:
    paths = write_prompt_files(tmp_path, [(3, 2), (3, 2), (3, 2)])
    (tmp_path / "sub").mkdir()
    nested = write_prompt_files(tmp_path / "sub", [(2, 2)])[0]
    _, by_glob = resolve_files(str(tmp_path / "part-*.parquet"))
    assert by_glob == [str(p) for p in paths]
    _, by_list = resolve_files(
        [str(paths[2]), str(tmp_path / "part-00[01].parquet"), str(paths[2])]
    )
    assert by_list == [str(paths[2]), str(paths[0]), str(paths[1])]
    _, by_folder = resolve_files(str(tmp_path))
    assert by_folder == sorted([*map(str, paths), str(nested)])
    _, recursive = resolve_files(str(tmp_path / "**" / "*.parquet"))
    assert recursive == sorted([*map(str, paths), str(nested)])


def test_file_uris_and_globs_in_subfolders(tmp_path: Path) -> None:
    for day in ("d1", "d2"):
        (tmp_path / day).mkdir()
        write_prompt_files(tmp_path / day, [(2, 2)])
    fs, paths = resolve_files(f"file://{tmp_path}/d*/part-*.parquet")
    assert isinstance(fs, pafs.LocalFileSystem)
    assert paths == [f"{tmp_path}/d1/part-000.parquet", f"{tmp_path}/d2/part-000.parquet"]
    with pytest.raises(DataError, match="matches no file"):
        resolve_files(str(tmp_path / "*.parquet"))  # `*` does not descend into folders


def test_a_glob_matching_nothing_names_the_pattern_and_setting(tmp_path: Path) -> None:
    pattern = str(tmp_path / "train-*.parquet")
    with pytest.raises(
        DataError, match=r"data\.train_files: the pattern .*train-\*\.parquet.* matches no file"
    ):
        resolve_files(pattern, what="data.train_files")


def test_missing_path_empty_spec_and_folder_without_parquet(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data\.val_files: file .*nope\.parquet' does not exist"):
        resolve_files(str(tmp_path / "nope.parquet"), what="data.val_files")
    with pytest.raises(DataError, match="is empty"):
        resolve_files([], what="data.train_files")
    with pytest.raises(DataError, match=r"holds no \*\.parquet file"):
        resolve_files(str(tmp_path))


def test_data_errors_are_user_errors() -> None:
    assert issubclass(DataError, MegarlError)
    assert issubclass(DataError, ValueError)


# ---- bad files -------------------------------------------------------------------------------


def _dataset(path: Path | str) -> PromptDataset:
    return PromptDataset(str(path), tokenizer=None, batch_size_per_rank=1, max_prompt_length=64)


def test_missing_column_names_file_and_column(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    rows = prompt_rows(0, 4)
    pq.write_table(
        pa.Table.from_pylist([{k: v for k, v in r.items() if k != "data_source"} for r in rows]),
        path,
    )
    with pytest.raises(DataError, match=rf"{path}: missing column 'data_source'"):
        _dataset(path)


def test_missing_ground_truth_is_refused_unless_not_required(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "data_source": "x"}] * 3), path)
    with pytest.raises(DataError, match=r"missing column 'reward_model'") as e:
        _dataset(path)
    assert "require_ground_truth" not in str(e.value)  # a constructor argument, not a setting
    ds = PromptDataset(
        str(path),
        tokenizer=None,
        batch_size_per_rank=1,
        max_prompt_length=8,
        require_ground_truth=False,
    )
    assert ds.num_rows == 3


@pytest.mark.parametrize(
    ("column", "values", "expected"),
    [
        (
            "prompt",
            [1, 2],
            r"column 'prompt' has type int64; expected a string or a list of chat messages",
        ),
        (
            "prompt",
            [[1, 2], [3]],
            r"column 'prompt' has type list<\w+: int64>; expected a string or a list",
        ),
        ("data_source", [1, 2], r"column 'data_source' has type int64; expected string"),
        (
            "reward_model",
            ["7", "8"],
            r"column 'reward_model' has type string; expected a struct with a 'ground_truth'",
        ),
    ],
)
def test_wrong_column_type_names_file_column_and_fix(
    tmp_path: Path, column: str, values: list, expected: str
) -> None:
    path = tmp_path / "bad.parquet"
    rows = prompt_rows(0, len(values))
    for r, v in zip(rows, values, strict=True):
        r[column] = v
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=rf"{path}: {expected}"):
        _dataset(path)


def test_file_without_rows_and_zero_byte_file(tmp_path: Path) -> None:
    empty_rows = tmp_path / "norows.parquet"
    pq.write_table(pa.Table.from_pylist(prompt_rows(0, 1)).slice(0, 0), empty_rows)
    with pytest.raises(DataError, match=rf"{empty_rows}: has no rows"):
        _dataset(empty_rows)
    zero = tmp_path / "zero.parquet"
    zero.write_bytes(b"")
    with pytest.raises(DataError, match=rf"{zero}: not a readable parquet file.*truncated"):
        _dataset(zero)


def test_truncated_and_non_parquet_files_are_named(tmp_path: Path) -> None:
    good = write_prompt_files(tmp_path, [(50, 10)])[0]
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataError, match=rf"{cut}: not a readable parquet file"):
        _dataset(cut)
    text = tmp_path / "notes.parquet"
    text.write_text("id,prompt\n1,hello\n")
    with pytest.raises(DataError, match=rf"{text}: not a readable parquet file"):
        _dataset(text)


def test_damaged_row_group_is_named_when_read(tmp_path: Path) -> None:
    """Footer intact, data pages overwritten: found when the row group is read, with its number."""
    path = tmp_path / "damaged.parquet"
    table = pa.Table.from_pylist(prompt_rows(0, 200, pad=20))
    pq.write_table(table, path, row_group_size=100, compression="snappy")
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(1).column(1)  # the prompt column of row group 1
    start = col.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    path.write_bytes(bytes(data))
    ds = PromptDataset(
        str(path),
        tokenizer=None,
        batch_size_per_rank=200,
        max_prompt_length=64,
        shuffle=False,
        apply_chat_template=False,
        require_ground_truth=True,
    )
    with pytest.raises(DataError, match=rf"{path}: reading row group 1 failed"):
        list(ds.reader.iter_rows(0))


def test_footers_describe_row_groups_and_fingerprint_ignores_folder(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_prompt_files(tmp_path / "a", [(25, 10), (7, 7)])
    write_prompt_files(tmp_path / "b", [(25, 10), (7, 7)])
    fs, paths = resolve_files(str(tmp_path / "a"))
    infos = inspect_files(fs, paths)
    assert [f.row_group_rows for f in infos] == [(10, 10, 5), (7,)]
    assert [f.num_rows for f in infos] == [25, 7]
    fs_b, paths_b = resolve_files(str(tmp_path / "b"))
    assert fingerprint(infos) == fingerprint(inspect_files(fs_b, paths_b))
    write_prompt_files(tmp_path / "b", [(25, 5)])
    assert fingerprint(infos) != fingerprint(
        inspect_files(fs_b, resolve_files(str(tmp_path / "b"))[1])
    )
