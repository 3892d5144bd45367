"""What a generative judge reads and how its answer becomes a score (``reward.judge``), no I/O.

The judge reads ``reward.judge.template`` with ``{prompt}`` (the row's question: its last user
message, or its text), ``{response}`` and ``{ground_truth}`` filled in. Only the template is a
format string: braces in a response or a prompt stay text. Its answer scores the last match of
``reward.judge.score_pattern`` (the pattern's first group, a finite number); an answer without
one is an :class:`UnparsedAnswer`, which the run counts as a failed sample.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megarl.config import JudgeConfig
from megarl.errors import ConfigError
from megarl.rewards.manager import RewardSample

FIELDS = ("prompt", "response", "ground_truth")
SHOWN_CHARS = 300  # how much of an unparsed answer an error shows


class UnparsedAnswer(ValueError):
    """A judge's answer holding no finite score; the message shows the answer."""


def template_fields(template: str) -> set[str]:
    """The fields ``template`` names; a ConfigError for a malformed one or an unknown field."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ConfigError(
            f"reward.judge.template is not a valid template ({e}); write literal braces as "
            "{{ and }}"
        ) from e
    names = {name for _, name, _, _ in parsed if name is not None}
    unknown = sorted(n for n in names if n not in FIELDS)
    if unknown or "" in names:
        shown = unknown or ["{}"]
        raise ConfigError(
            f"reward.judge.template names {shown}; it may name only {{prompt}}, {{response}} "
            "and {ground_truth} (literal braces as {{ and }})"
        )
    return names


def compile_score_pattern(pattern: str) -> re.Pattern[str]:
    """``reward.judge.score_pattern`` compiled; a ConfigError unless it has a group."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"reward.judge.score_pattern={pattern!r} is not a regex: {e}") from e
    if compiled.groups < 1:
        raise ConfigError(
            f"reward.judge.score_pattern={pattern!r} has no group; put the number in one, e.g. "
            r"'Score:\s*(-?\d+(?:\.\d+)?)'"
        )
    return compiled


def question_text(prompt: object) -> str:
    """A row's prompt as the judge reads it: its text, or its last user message's content ("" for
    messages without one)."""
    tolist = getattr(prompt, "tolist", None)  # a parquet list column read as a numpy array
    if callable(tolist):
        prompt = tolist()
    if prompt is None:
        return ""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
        users = [m for m in prompt if m.get("role") == "user"]
        return str(users[-1].get("content", "")) if users else ""
    return str(prompt)


def _shown(text: str) -> str:
    return repr(text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "...")


@dataclass(frozen=True)
class JudgeTemplate:
    """The judge's prompt for a sample and the score of its answer."""

    text: str
    pattern: re.Pattern[str]

    @classmethod
    def from_config(cls, judge: JudgeConfig) -> JudgeTemplate:
        fields = template_fields(judge.template)
        if "response" not in fields:
            raise ConfigError(
                "reward.judge.template has no {response}: the judge would never see what it "
                "scores; add {response} (and {prompt} for the question)"
            )
        return cls(judge.template, compile_score_pattern(judge.score_pattern))

    def prompt(self, sample: RewardSample) -> str:
        truth = sample.ground_truth
        return self.text.format_map(
            {
                "prompt": question_text(sample.prompt),
                "response": sample.solution_str,
                "ground_truth": "" if truth is None else str(truth),
            }
        )

    def score(self, answer: str) -> float:
        """The number in the pattern's first group of its last match in ``answer``."""
        matches = list(self.pattern.finditer(answer))
        if not matches:
            raise UnparsedAnswer(
                f"no match of reward.judge.score_pattern={self.pattern.pattern!r} in the "
                f"judge's answer {_shown(answer)}"
            )
        group = matches[-1].group(1)
        try:
            value = float(group)
        except (TypeError, ValueError):
            raise UnparsedAnswer(
                f"reward.judge.score_pattern's group matched {group!r}, not a number, in the "
                f"judge's answer {_shown(answer)}"
            ) from None
        if not math.isfinite(value):
            raise UnparsedAnswer(f"the judge's score {group!r} is not finite: {_shown(answer)}")
        return value
