"""Whether two models read token ids the same way (a teacher and its student, a reference and its
policy): the same vocabulary, id for id, and the same special tokens."""

from __future__ import annotations

from pathlib import Path


def tokenizer_difference(path_a: str | Path, path_b: str | Path) -> str | None:
    """How the tokenizers of two Hugging Face folders differ (None: they are the same)."""
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(path_a), AutoTokenizer.from_pretrained(path_b)
    vocab_a, vocab_b = a.get_vocab(), b.get_vocab()
    if len(vocab_a) != len(vocab_b):
        return f"{len(vocab_a)} tokens against {len(vocab_b)}"
    for token, index in vocab_a.items():
        if vocab_b.get(token) != index:
            return f"token {token!r} is id {index} in one and {vocab_b.get(token)} in the other"
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(a, name, None) != getattr(b, name, None):
            return f"{name} {getattr(a, name, None)} against {getattr(b, name, None)}"
    return None
