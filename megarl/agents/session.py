"""One sample's session at the agent endpoint: what was sampled, as token ids, in segments.

A segment is a :class:`~megarl.envs.trajectory.Trajectory` like the multi-turn rollout's: the
first request's prompt ids, then each model turn exactly as sampled (mask 1, the engine's
logprobs) and between turns the tokens the agent's new messages add (mask 0), never a
re-tokenisation of what the model wrote.

The continuation rule. A request continues the session's last segment when it is of the same kind
and

- chat: its tools are the same and its messages are the last request's messages followed by the
  reply the endpoint gave, unchanged (compared normalised: :func:`message_key`), followed by at
  least one new message; the new messages are appended as the chat template's delta
  (:meth:`~megarl.envs.chat_deltas.ChatDeltas.env_ids`);
- completions: its prompt (text) starts with the last prompt followed by the returned text, or
  (token ids) with the segment's ids, and adds something; what it adds is appended as text.

Anything else (an edited or dropped message, other tools, a different system prompt, another
kind of request) starts a new segment with the request's own rendering, and counts one
non-continuation. Training trains a sample's last segment (megarl.agents.trajectories).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Literal

from megarl.agents.openai_format import Message, message_key
from megarl.envs.trajectory import Trajectory

Kind = Literal["chat", "completion"]


@dataclass
class Segment:
    trajectory: Trajectory
    kind: Kind
    tools_key: str = ""  # chat: the request's tools, normalised
    history: list[str] = field(default_factory=list)  # chat: keys of the messages and last reply
    text: str | None = None  # completion with a text prompt: prompt and replies so far
    stop_text: str | None = None  # the last turn's stop token as text; None: cut at its limit
    finish: str = "stop"  # the last turn's: stop | length

    @property
    def prompt_len(self) -> int:
        """Ids of the segment's first prompt: what follows them is its (trained) response."""
        return len(self.trajectory.prompt_ids)

    @property
    def context(self) -> list[int]:
        """Every id of the segment: what the next turn's prompt starts with."""
        return self.trajectory.prompt_ids + self.trajectory.response_ids


def chat_continuation(
    segment: Segment | None, messages: list[Message], tools_key: str
) -> list[Message] | None:
    """The messages a chat request adds to ``segment``, or None when it does not continue it."""
    if segment is None or segment.kind != "chat" or segment.tools_key != tools_key:
        return None
    n = len(segment.history)
    if len(messages) <= n or [message_key(m) for m in messages[:n]] != segment.history:
        return None
    return messages[n:]


def completion_continuation(
    segment: Segment | None, prompt: str | list[int]
) -> str | list[int] | None:
    """What a completions request's prompt adds to ``segment``, or None when it does not
    continue it."""
    if segment is None or segment.kind != "completion":
        return None
    if isinstance(prompt, str):
        if segment.text is None or len(prompt) <= len(segment.text):
            return None
        return prompt[len(segment.text) :] if prompt.startswith(segment.text) else None
    if segment.text is not None:
        return None
    context = segment.context
    if len(prompt) <= len(context) or prompt[: len(context)] != context:
        return None
    return prompt[len(context) :]


class Session:
    """The segments of one sample; its lock is held for the whole of each request (requests of
    one session run one at a time)."""

    def __init__(self, key: str, sample: int) -> None:
        self.key = key
        self.sample = sample
        self.segments: list[Segment] = []
        self.requests = 0  # answered requests (model turns), over all segments
        self.non_continuations = 0
        self.closed = False
        self.lock = threading.Lock()

    @property
    def last(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def start(self, segment: Segment) -> Segment:
        if self.segments:
            self.non_continuations += 1
        self.segments.append(segment)
        return segment

    def trajectories(self) -> list[Trajectory]:
        """The segments as trajectories, each ended by its last turn's finish when still open."""
        out = []
        for seg in self.segments:
            t = seg.trajectory
            if not t.done:
                t.end(seg.finish)
            t.turn_rewards = [None] * t.turns
            out.append(t)
        return out
