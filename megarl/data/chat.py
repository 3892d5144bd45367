"""Turning prompt and response cells into token ids with the tokenizer's own chat template.

Templates are rendered to text, then tokenised without adding special tokens (the template
already holds them). Rendering first keeps us independent of how a transformers release shapes
`apply_chat_template(tokenize=True)`'s return value. Message content is data: a spelling of a
control token in it stays text (megarl.data.literal_text), so only the template makes turns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from megarl.data.errors import DataError
from megarl.data.literal_text import Literals, plain_text_ids, spellings, tokenize_with_literals

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, Any]]


def to_messages(value: object, *, where: str, column: str, role: str = "user") -> Messages:
    """A cell as chat messages: a string becomes one `role` message; a message list is checked.

    Keys whose value is None are dropped: parquet structs give every row every field, and
    templates test for keys such as `tool_calls` being present.
    """
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, Sequence) and value and all(isinstance(m, Mapping) for m in value):
        out = []
        for m in value:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(
                    f"{where}: column '{column}' holds a message without a string 'role' and "
                    f"'content': {dict(m)!r}. Fix the row, or remove it."
                )
            out.append({k: v for k, v in m.items() if v is not None})
        return out
    raise DataError(
        f"{where}: column '{column}' holds {type(value).__name__} {value!r:.80}; expected a "
        "string or a non-empty list of {'role': ..., 'content': ...} messages."
    )


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The id that pads a batch: the tokenizer's pad token, else its eos (None when it has neither).

    It is also where transformers' sequence classifiers stop reading a row."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _require_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; give a "
            "tokenizer with one, or set apply_chat_template=False to tokenise prompts as plain text."
        )


def render_chats(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Messages],
    *,
    add_generation_prompt: bool,
    chat_template_kwargs: Mapping[str, object] | None = None,
) -> list[str]:
    """Each conversation as the text its chat template makes of it."""
    _require_template(tokenizer)
    kwargs = dict(chat_template_kwargs or {})
    return [
        tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        for conv in conversations
    ]


def encode_chats(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Messages],
    *,
    add_generation_prompt: bool,
    chat_template_kwargs: Mapping[str, object] | None = None,
) -> list[list[int]]:
    """Token ids of each conversation as its chat template renders it, the messages' strings
    tokenised as plain text (control tokens come from the template only)."""
    found = spellings(tokenizer)
    literals = [Literals(found) for _ in conversations]
    hidden = [lit.hide_messages(c) for lit, c in zip(literals, conversations, strict=True)]
    texts = render_chats(
        tokenizer,
        hidden,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs,
    )
    return tokenize_with_literals(tokenizer, texts, literals)


def tokenize_texts(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], *, add_special_tokens: bool
) -> list[list[int]]:
    """Token ids of each text (one batched call; fast tokenizers parallelise it)."""
    if not texts:
        return []
    return [
        list(ids)
        for ids in tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
    ]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Messages | str],
    *,
    apply_chat_template: bool = True,
    chat_template_kwargs: Mapping[str, object] | None = None,
) -> list[list[int]]:
    """Prompt ids ready for generation: the template with its assistant turn opened.

    Without a template, plain-string prompts are tokenised as they are (with the tokenizer's
    BOS/EOS rules); message lists are refused, as there is no right way to flatten them.
    """
    if apply_chat_template:
        convs = [
            to_messages(p, where="prompt", column="prompt") if isinstance(p, str) else p
            for p in prompts
        ]
        return encode_chats(
            tokenizer, convs, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs
        )
    texts = [p for p in prompts if isinstance(p, str)]
    if len(texts) != len(prompts):
        raise DataError(
            "prompts are chat messages but apply_chat_template=False; turn templating on, or "
            "store prompts as plain strings."
        )
    return plain_text_ids(tokenizer, texts, add_special_tokens=True)


def encode_responses(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Messages],
    responses: Sequence[Messages],
    *,
    chat_template_kwargs: Mapping[str, object] | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, response ids) per pair, such that prompt ids + response ids is the templated
    conversation: the response is the text the template adds after the opened assistant turn
    (the reply and its end-of-turn tokens), tokenised on its own. Message strings are plain text.
    """
    found = spellings(tokenizer)
    literals = [Literals(found) for _ in prompts]
    hidden_prompts = [lit.hide_messages(p) for lit, p in zip(literals, prompts, strict=True)]
    hidden_full = [  # the same markers for the prompt's strings in both renderings
        hp + lit.hide_messages(r)
        for lit, hp, r in zip(literals, hidden_prompts, responses, strict=True)
    ]
    prompt_texts = render_chats(
        tokenizer,
        hidden_prompts,
        add_generation_prompt=True,
        chat_template_kwargs=chat_template_kwargs,
    )
    full_texts = render_chats(
        tokenizer,
        hidden_full,
        add_generation_prompt=False,
        chat_template_kwargs=chat_template_kwargs,
    )
    tails = []
    for p, f in zip(prompt_texts, full_texts, strict=True):
        if not f.startswith(p):
            raise DataError(
                "the chat template renders a conversation that does not start with its own "
                "prompt (with the assistant turn opened), so prompt and response tokens cannot "
                f"be separated. Prompt text ends {p[-60:]!r}, conversation text has "
                f"{f[len(p) - 60 : len(p) + 20]!r} there; use a template without that rewriting."
            )
        tails.append(f[len(p) :])
    return (
        tokenize_with_literals(tokenizer, prompt_texts, literals),
        tokenize_with_literals(tokenizer, tails, literals),
    )
