"""Chat templating: the real Qwen2.5 tokenizer's ChatML on the prepared GSM8K parquet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megarl.data import DataError, PromptDataset
from megarl.data.chat import encode_prompts, to_messages
from tests.unit.test_data_files import qwen_tokenizer, tiny_tokenizer
from tests.unit.test_prepare_gsm8k import prepare_module

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Real Qwen2.5 ids of "<|im_start|>system\n" + QWEN_SYSTEM + "<|im_end|>\n<|im_start|>user\n"
QWEN_HEAD = [151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525]
QWEN_HEAD += [264, 10950, 17847, 13, 151645, 198, 151644, 872, 198]
QWEN_TAIL = [151645, 198, 151644, 77091, 198]  # "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gsm8k")
    prepare_module().prepare(
        out, "gsm-symbolic", train_size=48, test_size=16, seed=0, row_group_size=8
    )
    return out


def test_qwen25_chatml_on_prepared_gsm8k(gsm8k_dir: Path) -> None:
    tok = qwen_tokenizer()
    ds = PromptDataset(
        str(gsm8k_dir / "train.parquet"),
        tok,
        batch_size_per_rank=8,
        max_prompt_length=512,
        dp_rank=1,
        dp_size=2,
    )
    batches = list(ds)
    assert len(batches) == 3
    for item in (i for b in batches for i in b):
        question = item.prompt[0]["content"]
        assert question.endswith('give the final answer as a number after "####", like "#### 42".')
        expected = (
            f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        assert tok.decode(item.input_ids) == expected
        assert item.input_ids[: len(QWEN_HEAD)] == QWEN_HEAD
        assert item.input_ids[-len(QWEN_TAIL) :] == QWEN_TAIL
        assert item.input_ids.count(151644) == 3 and item.input_ids.count(151645) == 2
        assert item.data_source == "openai/gsm8k" and item.ground_truth.lstrip("-").isdigit()


def test_the_real_vocabulary_splits_digits_one_by_one() -> None:
    tok = qwen_tokenizer()
    assert tok("Hello, world!", add_special_tokens=False)["input_ids"] == [9707, 11, 1879, 0]
    assert tok.convert_ids_to_tokens(tok("#### 1234", add_special_tokens=False)["input_ids"]) == [
        "####",
        "Ġ",
        "1",
        "2",
        "3",
        "4",
    ]


def test_a_system_message_replaces_the_default_one() -> None:
    tok = qwen_tokenizer()
    with_system = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]
    ids = encode_prompts(tok, [with_system])[0]
    assert tok.decode(ids).startswith("<|im_start|>system\nBe terse.<|im_end|>")
    assert QWEN_SYSTEM not in tok.decode(ids)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (7, "holds int 7; expected a string or a non-empty list"),
        ([], "holds list"),
        ([{"role": "user"}], "holds a message without a string 'role' and 'content'"),
        (
            [{"role": "user", "content": None}],
            "holds a message without a string 'role' and 'content'",
        ),
    ],
)
def test_bad_prompt_cells_are_named(value: Any, expected: str) -> None:
    with pytest.raises(DataError, match=rf"f\.parquet: row 3: column 'prompt' {expected}"):
        to_messages(value, where="f.parquet: row 3", column="prompt")


def test_struct_null_fields_are_dropped_before_templating() -> None:
    messages = to_messages(
        [{"role": "user", "content": "hi", "tool_calls": None}], where="w", column="prompt"
    )
    assert messages == [{"role": "user", "content": "hi"}]


def test_tokenizer_without_template_and_messages_without_templating_are_refused() -> None:
    tok = tiny_tokenizer()
    bare = tok.__class__(tokenizer_object=tok.backend_tokenizer, unk_token="<unk>")
    assert not bare.chat_template
    with pytest.raises(DataError, match=r"has no chat template.*apply_chat_template=False"):
        encode_prompts(bare, ["hi"])
    with pytest.raises(DataError, match="chat messages but apply_chat_template=False"):
        encode_prompts(tok, [[{"role": "user", "content": "hi"}]], apply_chat_template=False)
