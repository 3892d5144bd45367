"""Preference pairs from parquet (`prompt`, `chosen`, `rejected`), sharded and resumable like prompts.

`chosen` and `rejected` are the assistant's reply as a string, or the messages that follow the
prompt. Each pair is tokenised with the chat template as prompt ids + response ids, so the loss
can mask the prompt. Pairs over `max_length` tokens (prompt + the longer response) follow an
explicit policy: "error" names the row, "filter" drops and counts it, "truncate" cuts the
responses' ends (a pair whose prompt leaves no room for a response is dropped and counted).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import pyarrow.fs as pafs

from megarl.data.batching import Rows
from megarl.data.chat import encode_responses, to_messages
from megarl.data.errors import DataError
from megarl.data.literal_text import plain_text_ids
from megarl.data.parquet_source import ParquetFileInfo
from megarl.data.schema import TEXT_OR_MESSAGES, check_columns
from megarl.data.sharded import ShardedDataset, check_truncation, open_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TruncationPolicy = Literal["error", "filter", "truncate"]
_COLUMNS = ("prompt", "chosen", "rejected")


def check_preference_files(infos: Sequence[ParquetFileInfo]) -> None:
    """Every file has prompt, chosen and rejected columns of text or chat messages."""
    for info in infos:
        check_columns(
            info,
            dict.fromkeys(_COLUMNS, TEXT_OR_MESSAGES),
            hint="A preference file needs prompt, chosen and rejected columns.",
        )


@dataclass
class PreferenceItem:
    """One pair; the model sees prompt_ids + chosen_ids and prompt_ids + rejected_ids."""

    uid: int
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    truncated: bool = False
    extra: dict[str, object] = field(default_factory=dict)


class PreferenceDataset(ShardedDataset[PreferenceItem]):
    """This rank's preference pairs in lockstep batches; same sharding and state as PromptDataset."""

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: PreTrainedTokenizerBase,
        *,
        batch_size_per_rank: int,
        max_length: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        truncation: TruncationPolicy = "error",
        apply_chat_template: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
        window_rows: int = 8192,
        filesystem: pafs.FileSystem | None = None,
        setting: str = "data.train_files",
    ) -> None:
        check_truncation(truncation, max_length)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation = truncation
        self.apply_chat_template = apply_chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        fs, infos = open_files(files, filesystem, setting)
        check_preference_files(infos)
        super().__init__(
            fs,
            infos,
            self._encode,
            kind="preference",
            batch_size_per_rank=batch_size_per_rank,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
            window_rows=window_rows,
            counters=("truncated",),
        )

    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {
            "data/epoch": float(self.epoch),
            "data/filtered_pairs": float(c["dropped"]),
            "data/truncated_pairs": float(c.get("truncated", 0)),
            "data/refilled_pairs": float(c["refilled"]),
        }

    def _cells(self, rows: Rows) -> dict[str, list[Any]]:
        cells: dict[str, list[Any]] = {c: [] for c in _COLUMNS}
        for uid, row in rows:
            for c in _COLUMNS:
                if row.get(c) is None:
                    raise DataError(
                        f"{self._locate(uid)}: column '{c}' is empty (null); fill or remove the row."
                    )
                cells[c].append(row[c])
        return cells

    def _tokenize(self, rows: Rows) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        cells = self._cells(rows)
        if not self.apply_chat_template:
            if not all(isinstance(v, str) for c in _COLUMNS for v in cells[c]):
                raise DataError(
                    "preference cells are chat messages but apply_chat_template=False; turn "
                    "templating on, or store plain strings."
                )
            eos = getattr(self.tokenizer, "eos_token_id", None)
            tail = [] if eos is None else [eos]
            return (  # the cells are data: spellings of control tokens stay text
                plain_text_ids(self.tokenizer, cells["prompt"], add_special_tokens=True),
                [
                    ids + tail
                    for ids in plain_text_ids(
                        self.tokenizer, cells["chosen"], add_special_tokens=False
                    )
                ],
                [
                    ids + tail
                    for ids in plain_text_ids(
                        self.tokenizer, cells["rejected"], add_special_tokens=False
                    )
                ],
            )
        where = [self._locate(uid) for uid, _ in rows]
        prompts = [
            to_messages(v, where=w, column="prompt")
            for v, w in zip(cells["prompt"], where, strict=True)
        ]
        out = []
        for c in ("chosen", "rejected"):
            responses = [
                to_messages(v, where=w, column=c, role="assistant")
                for v, w in zip(cells[c], where, strict=True)
            ]
            out.append(
                encode_responses(
                    self.tokenizer,
                    prompts,
                    responses,
                    chat_template_kwargs=self.chat_template_kwargs,
                )
            )
        (prompt_ids, chosen_ids), (_, rejected_ids) = out
        return prompt_ids, chosen_ids, rejected_ids

    def _encode(self, rows: Rows) -> list[PreferenceItem | None]:
        prompt_ids, chosen_ids, rejected_ids = self._tokenize(rows)
        counters = self.counters
        items: list[PreferenceItem | None] = []
        for (uid, row), p, c, r in zip(rows, prompt_ids, chosen_ids, rejected_ids, strict=True):
            longest = len(p) + max(len(c), len(r))
            extra = {k: v for k, v in row.items() if k not in _COLUMNS}
            if longest <= self.max_length:
                items.append(PreferenceItem(uid, p, c, r, extra=extra))
                continue
            if self.truncation == "error":
                raise DataError(
                    f"{self._locate(uid)}: the pair is {longest} tokens (prompt {len(p)}, chosen "
                    f"{len(c)}, rejected {len(r)}), over max_length={self.max_length}. Raise "
                    "max_length, or set truncation='filter' (drop) or 'truncate' (cut responses)."
                )
            room = self.max_length - len(p)
            if self.truncation == "filter" or room < 1:
                items.append(None)
                continue
            counters["truncated"] = counters.get("truncated", 0) + 1
            items.append(PreferenceItem(uid, p, c[:room], r[:room], truncated=True, extra=extra))
        return items
