"""The post-training stages of the CPU toy task (the quickstart's ``vowel_rate`` reward on
GSM-Symbolic prompts), as data: SFT rows whose replies are made of vowels, and preference pairs
that prefer such a reply to one made of consonants. A tiny model learns both within minutes, so
each stage of the SFT -> DPO -> GRPO chain shows its effect on a CPU.

Replies are words of lower-case letters separated by spaces, drawn from a seeded RNG per prompt.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pyarrow as pa

VOWELS = "aeiou"
CONSONANTS = "bcdfghjklmnpqrstvwxz"


def reply(letters: str, rng: random.Random, words: tuple[int, int] = (3, 6)) -> str:
    """``words`` (a range) words of 2-5 ``letters`` each."""
    n = rng.randint(*words)
    return " ".join(
        "".join(rng.choice(letters) for _ in range(rng.randint(2, 5))) for _ in range(n)
    )


def _rng(seed: int, index: int, kind: str) -> random.Random:
    return random.Random(f"{seed}/{kind}/{index}")


def sft_rows(prompts: Sequence[object], seed: int = 0) -> list[dict[str, object]]:
    """One SFT row per prompt: the prompt and a reply of vowels."""
    return [
        {"prompt": p, "response": reply(VOWELS, _rng(seed, i, "sft"))}
        for i, p in enumerate(prompts)
    ]


def preference_rows(prompts: Sequence[object], seed: int = 0) -> list[dict[str, object]]:
    """One pair per prompt: a reply of vowels (chosen) against one of consonants (rejected)."""
    out = []
    for i, p in enumerate(prompts):
        rng = _rng(seed, i, "pair")
        out.append({"prompt": p, "chosen": reply(VOWELS, rng), "rejected": reply(CONSONANTS, rng)})
    return out


def table(rows: list[dict[str, object]]) -> pa.Table:
    return pa.Table.from_pylist(rows)
