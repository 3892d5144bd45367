"""The remote reward service's wire format (``reward.remote_url``), without any I/O.

Request, one per batch of samples::

    {"samples": [{"data_source": ..., "prompt": ..., "response": ...,
                  "ground_truth": ..., "extra_info": ...}, ...]}

Answer: ``{"scores": [s, ...]}``, one entry per sample in order; an entry is a finite number or an
object ``{"score": number, "<metric>": number, ...}`` whose other keys are numeric metrics of that
sample (logged as ``reward/remote/<metric>``). Anything else is a bad answer: the whole batch's
samples count as failed (:class:`BadAnswer` says why and shows the answer).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megarl.rewards.manager import RewardSample

SHOWN_ANSWER_CHARS = 300  # how much of a bad answer an error message shows


class BadAnswer(Exception):
    """An answer that does not hold one finite score per sample; the message shows it."""


@dataclass(frozen=True)
class RemoteScore:
    """One sample's score and the numeric metrics the service returned with it."""

    score: float
    metrics: dict[str, float] = field(default_factory=dict)


def _jsonable(value: object) -> object:
    """What ``json`` cannot write itself: numpy values and arrays as lists, the rest as text."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    return str(value)


def request_body(samples: Sequence[RewardSample]) -> bytes:
    """The JSON request for ``samples``, UTF-8."""
    rows = [
        {
            "data_source": s.data_source,
            "prompt": s.prompt,
            "response": s.solution_str,
            "ground_truth": s.ground_truth,
            "extra_info": s.extra_info,
        }
        for s in samples
    ]
    return json.dumps({"samples": rows}, default=_jsonable).encode()


def shown(answer: bytes | str) -> str:
    """An answer as an error message quotes it: its start, as text."""
    text = answer.decode("utf-8", "replace") if isinstance(answer, bytes) else answer
    if len(text) > SHOWN_ANSWER_CHARS:
        text = text[: SHOWN_ANSWER_CHARS - 3] + "..."
    return repr(text)


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadAnswer(f"{where} is {type(value).__name__} {value!r:.60}, not a number")
    out = float(value)
    if not math.isfinite(out):
        raise BadAnswer(f"{where} is {out}, not a finite number")
    return out


def _entry(value: object, i: int) -> RemoteScore:
    if not isinstance(value, dict):
        return RemoteScore(_number(value, f"scores[{i}]"))
    if "score" not in value:
        raise BadAnswer(f"scores[{i}] is an object without a 'score' key (keys {sorted(value)})")
    metrics = {str(k): _number(v, f"scores[{i}][{k!r}]") for k, v in value.items() if k != "score"}
    return RemoteScore(_number(value["score"], f"scores[{i}]['score']"), metrics)


def parse_answer(body: bytes, expected: int) -> list[RemoteScore]:
    """The ``expected`` scores of an answer's body; :class:`BadAnswer` for anything else."""
    try:
        answer: Any = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadAnswer(f"the answer is not JSON ({e}): {shown(body)}") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("scores"), list):
        raise BadAnswer(f'the answer is not an object with a "scores" list: {shown(body)}')
    scores = answer["scores"]
    if len(scores) != expected:
        raise BadAnswer(
            f"the answer has {len(scores)} scores for {expected} samples: {shown(body)}"
        )
    try:
        return [_entry(value, i) for i, value in enumerate(scores)]
    except BadAnswer as e:
        raise BadAnswer(f"{e}: {shown(body)}") from None
