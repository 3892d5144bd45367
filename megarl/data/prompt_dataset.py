"""RL prompts from parquet (verl's schema), sharded by data-parallel rank, in resumable batches.

Schema, per file:
- `prompt`: a string or a list of chat messages (required)
- `data_source`: string, routes the reward (required)
- `reward_model`: struct with `ground_truth` (required unless `require_ground_truth=False`)
- `extra_info`: anything (optional); every other column passes through in `PromptItem.extra`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import pyarrow.fs as pafs

from megarl.data.batching import Rows
from megarl.data.chat import encode_prompts, to_messages
from megarl.data.errors import DataError
from megarl.data.literal_text import too_long
from megarl.data.parquet_source import ParquetFileInfo
from megarl.data.schema import ANY, REWARD_MODEL, STRING, TEXT_OR_MESSAGES, check_columns
from megarl.data.sharded import ShardedDataset, open_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

OverlongPolicy = Literal["error", "filter"]
_KNOWN = ("prompt", "data_source", "reward_model", "extra_info")


def check_prompt_files(infos: Sequence[ParquetFileInfo], require_ground_truth: bool = True) -> None:
    """Every file has verl's RL parquet columns (``reward_model`` only if ``require_ground_truth``)."""
    required = {"prompt": TEXT_OR_MESSAGES, "data_source": STRING}
    if require_ground_truth:
        required["reward_model"] = REWARD_MODEL
    hint = (
        "Expected verl's RL parquet columns: prompt, data_source, reward_model.ground_truth "
        "(read by rule scorers), extra_info."
    )
    for info in infos:
        check_columns(info, required, {"reward_model": REWARD_MODEL, "extra_info": ANY}, hint=hint)


@dataclass
class PromptItem:
    """One prompt; `uid` (its row index in the dataset) is stable, e.g. as a GRPO group id."""

    uid: int
    input_ids: list[int]
    prompt: list[dict[str, Any]] | str
    data_source: str
    ground_truth: object
    reward_model: dict[str, object] | None = None
    extra_info: object = None
    extra: dict[str, object] = field(default_factory=dict)


class PromptDataset(ShardedDataset[PromptItem]):
    """This data-parallel rank's prompts, `batch_size_per_rank` at a time, in lockstep with the
    other ranks (the same `steps_per_epoch` everywhere).

    `for batch in dataset` yields the rest of the current epoch; then the state points at the next
    epoch. `state_dict()` after a batch, restored with `load_state_dict()` into a dataset built the
    same way, continues with exactly the next batch.

    Prompts longer than `max_prompt_length` tokens (after templating): `overlong_prompts="error"`
    stops with the file and row; `"filter"` drops them, counted in `metrics()`, and fills the batch
    with the next rows.

    Columns beyond the schema's pass through in `PromptItem.extra`; `extra_columns` limits them to
    a list (the others are then not even read).
    """

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: PreTrainedTokenizerBase,
        *,
        batch_size_per_rank: int,
        max_prompt_length: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        overlong_prompts: OverlongPolicy = "error",
        apply_chat_template: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
        require_ground_truth: bool = True,
        extra_columns: Sequence[str] | None = None,
        window_rows: int = 8192,
        filesystem: pafs.FileSystem | None = None,
        setting: str = "data.train_files",
    ) -> None:
        if overlong_prompts not in ("error", "filter"):
            raise DataError(
                f"overlong_prompts must be 'error' or 'filter', got {overlong_prompts!r}."
            )
        if max_prompt_length < 1:
            raise DataError(f"max_prompt_length must be >= 1, got {max_prompt_length}.")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.overlong_prompts = overlong_prompts
        self.apply_chat_template = apply_chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        fs, infos = open_files(files, filesystem, setting)
        check_prompt_files(infos, require_ground_truth)
        columns = None
        if extra_columns is not None:
            for info in infos:
                check_columns(info, dict.fromkeys(extra_columns, ANY), hint="(from extra_columns)")
            columns = [*_KNOWN, *extra_columns]
        super().__init__(
            fs,
            infos,
            self._encode,
            kind="prompt",
            batch_size_per_rank=batch_size_per_rank,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
            window_rows=window_rows,
            columns=columns,
        )

    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {
            "data/epoch": float(self.epoch),
            "data/filtered_overlong_prompts": float(c["dropped"]),
            "data/refilled_prompts": float(c["refilled"]),
        }

    def _encode(self, rows: Rows) -> list[PromptItem | None]:
        prompts = []
        fits = []  # whether the prompt's text can fit at all (checked before any templating)
        for uid, row in rows:
            value = row.get("prompt")
            if value is None:
                raise DataError(
                    f"{self._locate(uid)}: column 'prompt' is empty (null); fill or remove the row."
                )
            if not isinstance(row.get("data_source"), str):
                raise DataError(
                    f"{self._locate(uid)}: column 'data_source' is empty (null); fill or remove the row."
                )
            chars = too_long(self.tokenizer, value, self.max_prompt_length)
            if chars is not None and self.overlong_prompts == "error":
                raise DataError(
                    f"{self._locate(uid)}: the prompt holds {chars:,} characters, more than "
                    f"max_prompt_length={self.max_prompt_length} tokens can ever hold. Raise "
                    "max_prompt_length, or set overlong_prompts='filter' to drop (and count) "
                    "such prompts."
                )
            fits.append(chars is None)
            prompts.append(
                value
                if isinstance(value, str)
                else to_messages(value, where=self._locate(uid), column="prompt")
            )
        encoded = iter(
            encode_prompts(
                self.tokenizer,
                [p for p, ok in zip(prompts, fits, strict=True) if ok],
                apply_chat_template=self.apply_chat_template,
                chat_template_kwargs=self.chat_template_kwargs,
            )
        )
        ids = [next(encoded) if ok else None for ok in fits]
        items: list[PromptItem | None] = []
        for (uid, row), prompt, input_ids in zip(rows, prompts, ids, strict=True):
            if input_ids is None:
                items.append(None)  # far too long: dropped (overlong_prompts='filter')
                continue
            if len(input_ids) > self.max_prompt_length:
                if self.overlong_prompts == "error":
                    raise DataError(
                        f"{self._locate(uid)}: the prompt is {len(input_ids)} tokens after the chat "
                        f"template, over max_prompt_length={self.max_prompt_length}. Raise "
                        "max_prompt_length, or set overlong_prompts='filter' to drop (and count) such prompts."
                    )
                items.append(None)
                continue
            reward_model = row.get("reward_model")
            items.append(
                PromptItem(
                    uid=uid,
                    input_ids=input_ids,
                    prompt=prompt,
                    data_source=row["data_source"],
                    ground_truth=None if reward_model is None else reward_model.get("ground_truth"),
                    reward_model=reward_model,
                    extra_info=row.get("extra_info"),
                    extra={k: v for k, v in row.items() if k not in _KNOWN},
                )
            )
        return items
