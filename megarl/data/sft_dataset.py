"""Supervised fine-tuning rows from parquet, sharded and resumable like the other datasets.

A file holds either ``prompt`` (text or chat messages, as in the RL data) and ``response`` (the
assistant's reply: text or messages), or ``messages`` (a whole conversation). Each row becomes
prompt ids + response ids with a 0/1 loss mask over the response: the prompt is the conversation
up to the first assistant turn, rendered with the chat template and its generation prompt; every
assistant turn is trained with the end-of-turn tokens the template writes after it, the turns
between them (user, tool) are context only. When the last trained turn holds no EOS token of the
tokenizer, one is appended (trained), so that the model learns to stop.

Rows over ``max_length`` tokens follow ``truncation``: "error" names the row, "filter" drops and
counts it, "truncate" cuts the end of the response (a row left without a trained token is
dropped and counted).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import pyarrow.fs as pafs

from megarl.data.batching import Rows
from megarl.data.chat import Messages, render_chats, to_messages
from megarl.data.errors import DataError
from megarl.data.literal_text import Literals, spellings, tokenize_with_literals
from megarl.data.parquet_source import ParquetFileInfo
from megarl.data.schema import MESSAGES, TEXT_OR_MESSAGES, check_columns
from megarl.data.sharded import ShardedDataset, check_truncation, open_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TruncationPolicy = Literal["error", "filter", "truncate"]


def check_sft_files(infos: Sequence[ParquetFileInfo]) -> None:
    """Every file holds one of the two SFT formats (``messages``, or ``prompt`` + ``response``;
    a file with both columns may mix them row by row)."""
    for info in infos:
        names = set(info.schema.names)
        has_pairs = "prompt" in names and "response" in names
        if "messages" in names:
            check_columns(info, {"messages": MESSAGES})
        if has_pairs:
            check_columns(info, {"prompt": TEXT_OR_MESSAGES, "response": TEXT_OR_MESSAGES})
        if "messages" not in names and not has_pairs:
            raise DataError(
                f"{info.path}: an SFT file needs a 'messages' column (whole conversations, the "
                "loss on the assistant turns) or 'prompt' and 'response' columns; the file has "
                f"columns {sorted(names)}."
            )


@dataclass
class SFTItem:
    """One row; the model sees prompt_ids + response_ids and learns the response tokens whose
    ``loss_mask`` is 1."""

    uid: int
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True)
class _Pieces:
    """A conversation as text pieces: the prompt, then (text, trained) pieces of the response."""

    prompt: str
    response: list[tuple[str, bool]]
    literals: Literals  # the message strings the pieces hide (tokenised as plain text)


def _after(prefix: str, text: str, where: str) -> str:
    if not text.startswith(prefix):
        raise DataError(
            f"{where}: the chat template renders a longer conversation that does not start with "
            "its shorter part (it rewrites earlier turns), so the assistant turns cannot be cut "
            f"out of it. The shorter part ends {prefix[-60:]!r}; use a template without that "
            "rewriting, or prompt + response rows."
        )
    return text[len(prefix) :]


def conversation_pieces(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    where: str,
    chat_template_kwargs: Mapping[str, object],
) -> _Pieces:
    """Cut a conversation's rendering into the prompt and the response pieces (assistant turns
    trained, the turns between them not); turns after the last assistant turn are dropped."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DataError(
            f"{where}: the conversation has no assistant turn to learn; fill or remove the row."
        )

    literals = Literals(spellings(tokenizer))
    hidden = literals.hide_messages(messages)  # control tokens come from the template only

    def render(upto: int, opened: bool) -> str:
        [text] = render_chats(
            tokenizer,
            [hidden[:upto]],
            add_generation_prompt=opened,
            chat_template_kwargs=chat_template_kwargs,
        )
        return text

    prompt = done = render(turns[0], True)
    pieces: list[tuple[str, bool]] = []
    for i in turns:
        opened = render(i, True)
        if i != turns[0]:
            pieces.append((_after(done, opened, where), False))
        done = render(i + 1, False)
        pieces.append((_after(opened, done, where), True))
    return _Pieces(prompt, pieces, literals)


class SFTDataset(ShardedDataset[SFTItem]):
    """This rank's SFT rows in lockstep batches; same sharding and state as the other datasets."""

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
        chat_template_kwargs: Mapping[str, object] | None = None,
        window_rows: int = 8192,
        filesystem: pafs.FileSystem | None = None,
        setting: str = "data.train_files",
    ) -> None:
        check_truncation(truncation, max_length)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation = truncation
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        fs, infos = open_files(files, filesystem, setting)
        check_sft_files(infos)
        super().__init__(
            fs,
            infos,
            self._encode,
            kind="sft",
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
            "data/filtered_rows": float(c["dropped"]),
            "data/truncated_rows": float(c.get("truncated", 0)),
            "data/refilled_rows": float(c["refilled"]),
        }

    def _cell(self, uid: int, row: dict[str, object], column: str) -> object:
        if row.get(column) is None:
            raise DataError(
                f"{self._locate(uid)}: column '{column}' is empty (null); fill or remove the row."
            )
        return row[column]

    def _conversation(self, uid: int, row: dict[str, object]) -> Messages:
        where = self._locate(uid)
        if row.get("messages") is not None or "response" not in row:
            return to_messages(self._cell(uid, row, "messages"), where=where, column="messages")
        prompt = to_messages(self._cell(uid, row, "prompt"), where=where, column="prompt")
        reply = to_messages(
            self._cell(uid, row, "response"), where=where, column="response", role="assistant"
        )
        return prompt + reply

    def _tokenize(self, pieces: list[_Pieces]) -> list[tuple[list[int], list[int], list[int]]]:
        texts = [p.prompt for p in pieces] + [t for p in pieces for t, _ in p.response]
        literals = [p.literals for p in pieces] + [p.literals for p in pieces for _ in p.response]
        ids = iter(tokenize_with_literals(self.tokenizer, texts, literals))
        prompts = [next(ids) for _ in pieces]
        out = []
        for prompt, p in zip(prompts, pieces, strict=True):
            response: list[int] = []
            mask: list[int] = []
            part: list[int] = []
            for _, trained in p.response:  # the last piece is the last assistant turn
                part = next(ids)
                response += part
                mask += [int(trained)] * len(part)
            if self.eos_id is not None and self.eos_id not in part:
                response.append(self.eos_id)
                mask.append(1)
            out.append((prompt, response, mask))
        return out

    def _encode(self, rows: Rows) -> list[SFTItem | None]:
        pieces = [
            conversation_pieces(
                self.tokenizer,
                self._conversation(uid, row),
                self._locate(uid),
                self.chat_template_kwargs,
            )
            for uid, row in rows
        ]
        items: list[SFTItem | None] = []
        for (uid, row), (p, r, m) in zip(rows, self._tokenize(pieces), strict=True):
            extra = {k: v for k, v in row.items() if k not in ("prompt", "response", "messages")}
            item = self._fit(SFTItem(uid, p, r, m, extra=extra))
            items.append(item)
        return items

    def _fit(self, item: SFTItem) -> SFTItem | None:
        total = len(item.prompt_ids) + len(item.response_ids)
        if total <= self.max_length:
            return item
        if self.truncation == "error":
            raise DataError(
                f"{self._locate(item.uid)}: the row is {total} tokens (prompt "
                f"{len(item.prompt_ids)}, response {len(item.response_ids)}), over "
                f"max_length={self.max_length}. Raise max_length, or set truncation='filter' "
                "(drop) or 'truncate' (cut the response's end)."
            )
        room = self.max_length - len(item.prompt_ids)
        if self.truncation == "filter" or room < 1 or not any(item.loss_mask[:room]):
            return None
        self.counters["truncated"] = self.counters.get("truncated", 0) + 1
        return SFTItem(
            item.uid,
            item.prompt_ids,
            item.response_ids[:room],
            item.loss_mask[:room],
            truncated=True,
            extra=item.extra,
        )
