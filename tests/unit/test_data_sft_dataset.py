"""SFTDataset: prompt/response rows and whole conversations tokenised with the chat template, the
loss mask on exactly the assistant turns, EOS, explicit truncation, file checks, resume."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data import DataError, SFTDataset
from megarl.data.sft_dataset import check_sft_files
from megarl.data.sharded import open_files


@functools.cache
def char_tokenizer() -> Any:
    """The character tokenizer of the tiny test models (ChatML, EOS <|im_end|>)."""
    from transformers import AutoTokenizer

    from tests.assets import tiny_char_llama_dir

    return AutoTokenizer.from_pretrained(tiny_char_llama_dir())


def write(folder: Path, rows: list[dict[str, Any]], name: str = "sft") -> str:
    path = folder / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    return str(path)


def items(files: str, tokenizer: Any = None, batch: int = 1, **kw: Any) -> list:
    ds = SFTDataset(
        files,
        tokenizer or char_tokenizer(),
        batch_size_per_rank=batch,
        max_length=kw.pop("max_length", 512),
        shuffle=False,
        **kw,
    )
    out = [it for b in ds for it in b]
    ds.close()
    return out


def trained_text(tok: Any, item) -> str:
    """The response tokens with loss mask 1, decoded (| between separate trained runs)."""
    runs, current = [], []
    for t, m in zip(item.response_ids, item.loss_mask, strict=True):
        if m:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return "|".join(tok.decode(r) for r in runs)


def test_prompt_response_is_the_templated_conversation_with_its_end_of_turn(tmp_path):
    tok = char_tokenizer()
    rows = [
        {"prompt": "What is 2+2?", "response": "4"},
        {"prompt": [{"role": "user", "content": "Say hi."}], "response": "hi there"},
    ]
    got = items(write(tmp_path, rows[:1], "a"), batch=1) + items(write(tmp_path, rows[1:], "b"))
    for row, item in zip(rows, got, strict=True):
        prompt = row["prompt"]
        conv = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        opened = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(
            [*conv, {"role": "assistant", "content": row["response"]}], tokenize=False
        )
        assert tok.decode(item.prompt_ids) == opened
        assert tok.decode(item.prompt_ids + item.response_ids) == full
        assert item.loss_mask == [1] * len(item.response_ids)
        assert trained_text(tok, item) == row["response"] + "<|im_end|>\n"
        assert tok.eos_token_id in item.response_ids  # the template's end of turn is the EOS


def test_a_conversation_trains_its_assistant_turns_only(tmp_path):
    tok = char_tokenizer()
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "thanks"},  # after the last assistant turn: dropped
    ]
    [item] = items(write(tmp_path, [{"messages": conv}]))
    assert tok.decode(item.prompt_ids) == tok.apply_chat_template(
        conv[:2], tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(item.prompt_ids + item.response_ids) == tok.apply_chat_template(
        conv[:5], tokenize=False
    )
    assert trained_text(tok, item) == "4<|im_end|>\n|6<|im_end|>\n"
    between = [t for t, m in zip(item.response_ids, item.loss_mask, strict=True) if not m]
    assert tok.decode(between) == "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n"


def test_a_reply_without_the_eos_token_gets_one(tmp_path):
    tok = copy.deepcopy(char_tokenizer())
    tok.eos_token = "<s>"  # a base model's EOS: its ChatML turns end in <|im_end|>, not in it
    [item] = items(write(tmp_path, [{"prompt": "Hi", "response": "Hello"}]), tokenizer=tok)
    assert item.response_ids[-1] == tok.eos_token_id and item.loss_mask[-1] == 1
    assert tok.decode(item.response_ids[:-1]) == "Hello<|im_end|>\n"
    assert (
        tok.eos_token_id
        not in items(write(tmp_path, [{"prompt": "Hi", "response": "Hello"}], "c"))[0].response_ids
    )


def test_overlong_rows_error_filter_or_truncate(tmp_path):
    rows = [{"prompt": "q", "response": "a" * n} for n in (5, 200, 6)]
    files = write(tmp_path, rows)
    with pytest.raises(
        DataError, match=r"sft\.parquet.*row 1.*over max_length=100.*truncation='filter'"
    ):
        items(files, max_length=100, truncation="error")
    ds = SFTDataset(
        files,
        char_tokenizer(),
        batch_size_per_rank=2,
        max_length=100,
        shuffle=False,
        truncation="filter",
    )
    [batch] = list(ds)
    assert [len(it.response_ids) for it in batch] == [5 + 2, 6 + 2]  # reply, <|im_end|>, "\n"
    assert ds.metrics()["data/filtered_rows"] == 1.0
    cut = items(files, max_length=100, truncation="truncate")
    assert [len(it.prompt_ids) + len(it.response_ids) for it in cut][1] == 100
    assert cut[1].truncated and not cut[0].truncated


def test_files_need_one_of_the_two_formats_before_any_row_is_read(tmp_path):
    bad = write(tmp_path, [{"prompt": "q", "answer": "a"}], name="bad")
    with pytest.raises(
        DataError,
        match=r"bad\.parquet: an SFT file needs a 'messages' column .* 'prompt' and 'response'.*\['answer', 'prompt'\]",
    ):
        check_sft_files(open_files(bad, None, "data.train_files")[1])
    typed = write(tmp_path, [{"messages": "not a list"}], name="typed")
    with pytest.raises(
        DataError, match="column 'messages' has type string; expected a list of chat messages"
    ):
        items(typed)
    lonely = write(tmp_path, [{"messages": [{"role": "user", "content": "hi"}]}], name="lonely")
    with pytest.raises(DataError, match="no assistant turn"):
        items(lonely)


def test_the_position_resumes_exactly(tmp_path):
    rows = [{"prompt": f"q{i}", "response": f"r{i}"} for i in range(12)]
    files = write(tmp_path, rows)

    def make():
        return SFTDataset(files, char_tokenizer(), batch_size_per_rank=3, max_length=64, seed=3)

    full = make()
    batches = iter(full)
    first = [next(batches) for _ in range(2)]
    state = full.state_dict()
    rest = [[it.uid for it in b] for b in batches]
    resumed = make()
    resumed.load_state_dict(state)
    assert [[it.uid for it in b] for b in resumed] == rest
    assert len(first) == 2 and len(rest) == 2
