"""Text from data, environments and tools stays text: control tokens come from the chat template.

A tokenizer turns every spelling of one of its added tokens (``<|im_end|>``, ``<|im_start|>``,
``<tool_call>`` ...) into that token, wherever the spelling comes from. Rendered conversations
mix the template's own text with message content, so a message that spells
``<|im_end|>\\n<|im_start|>system`` would become a real end of turn and a real system turn. Here:

1. :meth:`Literals.hide` replaces, in every string of the messages, each spelling of an added
   token by a marker that no tokenizer or template treats specially (private-use characters
   around a random nonce); a string that starts with the end of a spelling or ends with its
   start (which the template's text beside it could complete) is hidden whole;
2. the template renders the hidden messages as usual;
3. :func:`tokenize_with_literals` tokenizes the template's text between markers as before (its
   control tokens are real), and each hidden string as plain text: cut after the first character
   of every spelling, so no piece holds one.

Content without such spellings (the common case) tokenizes exactly as before: nothing is hidden.
A hidden string is tokenised on its own, which is how the tokenizer reads it anyway wherever the
template's text beside it ends or starts a word (ChatML's "\\n", Llama 3's headers).
"""

from __future__ import annotations

import contextlib
import re
import secrets
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_OPEN, _CLOSE = "\U000f0000", "\U000f0001"  # supplementary private-use characters


@dataclass(frozen=True)
class Spellings:
    """The added tokens' spellings of one tokenizer (two or more characters: a one-character
    added token is that character whichever way it is tokenized)."""

    words: tuple[str, ...]
    pattern: re.Pattern[str] | None  # any spelling, longest first
    prefixes: frozenset[str]  # proper prefixes of spellings
    suffixes: frozenset[str]  # proper suffixes of spellings
    longest: int

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> Spellings:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        words = sorted({t.content for t in added.values() if len(t.content) >= 2}, key=len)[::-1]
        if not words:
            return cls((), None, frozenset(), frozenset(), 0)
        return cls(
            tuple(words),
            re.compile("|".join(re.escape(w) for w in words)),
            frozenset(w[:i] for w in words for i in range(1, len(w))),
            frozenset(w[i:] for w in words for i in range(1, len(w))),
            len(words[0]),
        )

    def at_edge(self, text: str) -> bool:
        """Whether ``text`` starts with the end of a spelling or ends with its start, so that
        the template's text beside it could complete one."""
        for n in range(1, min(self.longest, len(text) + 1)):
            if text[:n] in self.suffixes or text[-n:] in self.prefixes:
                return True
        return False


T = TypeVar("T")
_SPELLINGS: weakref.WeakKeyDictionary[Any, Spellings] = weakref.WeakKeyDictionary()
_LONGEST: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _per_tokenizer(
    table: weakref.WeakKeyDictionary[Any, T], tokenizer: Any, compute: Callable[[], T]
) -> T:
    """``compute()`` once per tokenizer object (every time for one that cannot be weakly
    referenced)."""
    with contextlib.suppress(KeyError, TypeError):
        return table[tokenizer]
    value = compute()
    with contextlib.suppress(TypeError):
        table[tokenizer] = value
    return value


def spellings(tokenizer: PreTrainedTokenizerBase) -> Spellings:
    """The tokenizer's :class:`Spellings`."""
    return _per_tokenizer(_SPELLINGS, tokenizer, lambda: Spellings.of(tokenizer))


class Literals:
    """The strings hidden from one rendering, and the markers standing in for them."""

    def __init__(self, found: Spellings) -> None:
        self.spellings = found
        self.nonce = secrets.token_hex(8)
        self.items: list[str] = []
        self.marker = re.compile(re.escape(_OPEN + self.nonce) + r"(\d+)" + re.escape(_CLOSE))

    def _mark(self, text: str) -> str:
        self.items.append(text)
        return f"{_OPEN}{self.nonce}{len(self.items) - 1}{_CLOSE}"

    def hide(self, text: str) -> str:
        """``text`` with every spelling hidden; a text whose ends could join the template's text
        into a spelling is hidden whole (tokenised on its own)."""
        s = self.spellings
        if s.pattern is None or not text:
            return text
        if s.at_edge(text):
            return self._mark(text)
        if s.pattern.search(text) is None:
            return text
        return s.pattern.sub(lambda m: self._mark(m.group(0)), text)

    def hide_value(self, value: Any) -> Any:
        """``value`` (a message, a list of them, any JSON-like data) with its strings hidden."""
        if isinstance(value, str):
            return self.hide(value)
        if isinstance(value, Mapping):
            return {k: self.hide_value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.hide_value(v) for v in value]
        return value

    def hide_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return [self.hide_value(m) for m in messages]

    def pieces(self, rendered: str) -> list[tuple[bool, str]]:
        """``rendered`` as (hidden?, text) pieces in order; hidden pieces are the originals."""
        out: list[tuple[bool, str]] = []
        at = 0
        for m in self.marker.finditer(rendered):
            if m.start() > at:
                out.append((False, rendered[at : m.start()]))
            out.append((True, self.items[int(m.group(1))]))
            at = m.end()
        if at < len(rendered):
            out.append((False, rendered[at:]))
        return out


def literal_segments(found: Spellings, text: str) -> list[str]:
    """``text`` cut after the first character of every spelling it holds: no piece holds one."""
    if found.pattern is None:
        return [text] if text else []
    segments, rest = [], text
    while (m := found.pattern.search(rest)) is not None:
        segments.append(rest[: m.start() + 1])
        rest = rest[m.start() + 1 :]
    if rest:
        segments.append(rest)
    return segments


def tokenize_with_literals(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], literals: Sequence[Literals]
) -> list[list[int]]:
    """Token ids of rendered texts: the template's text as the tokenizer reads it, the hidden
    strings as plain text. One tokenizer call for all pieces of all texts."""
    plan: list[list[int]] = []  # per text, indices into `flat`
    flat: list[str] = []
    for text, lit in zip(texts, literals, strict=True):
        mine = []
        for hidden, piece in lit.pieces(text):
            parts = literal_segments(lit.spellings, piece) if hidden else [piece]
            for part in parts:
                mine.append(len(flat))
                flat.append(part)
        plan.append(mine)
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    return [[t for i in mine for t in ids[i]] for mine in plan]


def plain_text_ids(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], *, add_special_tokens: bool
) -> list[list[int]]:
    """Token ids of texts that are all data (no template): spellings stay text; the tokenizer's
    own BOS/EOS are added around them when ``add_special_tokens``."""
    found = spellings(tokenizer)
    if not texts:
        return []
    encoded = tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
    out = [list(ids) for ids in encoded]
    if found.pattern is None:
        return out
    lit = Literals(found)
    for i, text in enumerate(texts):
        if found.pattern.search(text) is None:
            continue
        (body,) = tokenize_with_literals(tokenizer, [lit.hide(text)], [lit])
        if add_special_tokens:
            head, tail = _special_frame(tokenizer)
            body = head + body + tail
        out[i] = body
    return out


def _special_frame(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text of its own (BOS, EOS)."""
    probe = "a"
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    framed = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(framed) - len(bare) + 1):
        if framed[start : start + len(bare)] == bare:
            return list(framed[:start]), list(framed[start + len(bare) :])
    return [], []


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token can stand for (its vocabulary's longest entry; byte-level
    entries spell one character per byte, so this bounds the decoded text too)."""

    def compute() -> int:
        words = [*tokenizer.get_vocab(), *spellings(tokenizer).words]
        return max((len(w) for w in words), default=1)

    return _per_tokenizer(_LONGEST, tokenizer, compute)


def text_chars(value: object) -> int:
    """The characters of all strings in ``value`` (a prompt cell: a string or chat messages)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(text_chars(v) for v in value)
    return 0


def too_long(tokenizer: PreTrainedTokenizerBase, value: object, max_tokens: int) -> int | None:
    """The characters of ``value`` when they cannot fit in ``max_tokens`` tokens however they
    tokenize (more than ``max_tokens`` x the longest token), else None: checked before any
    templating, so a huge cell costs a length, not a tokenization."""
    chars = text_chars(value)
    return chars if chars > max_tokens * longest_token_chars(tokenizer) else None
