"""One request of a session: its prompt as token ids (continued or a new segment), one model turn
through the :class:`~megarl.agents.generation.Generator`, recorded, and the reply.

Token ids end to end: a new segment's prompt is the request rendered with the model's chat
template (message and tool-schema strings as data: megarl.data.literal_text keeps a spelling of
a control token in them text), a continuation is the segment's ids plus the template's delta for
the new messages (megarl.envs.chat_deltas). The reply's text is decoded from the sampled ids; the
tool calls in it are read by the model family's tool-call parser (megarl.envs.tool_parsers).

Each request's seed is the multi-turn rollout's for (run seed, rollout, sample, request number
in the session), so a session's turns draw their own streams whatever the layout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megarl.agents.generation import Generator
from megarl.agents.openai_format import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    Message,
    Reply,
    message_key,
)
from megarl.agents.session import (
    Segment,
    Session,
    chat_continuation,
    completion_continuation,
)
from megarl.data.literal_text import plain_text_ids, too_long
from megarl.envs.base import EnvError
from megarl.envs.chat_deltas import ChatDeltas
from megarl.envs.tool_parsers import (
    TOOL_PARSERS,
    ToolParser,
    parse_contained,
    text_without_calls,
)
from megarl.envs.trajectory import Trajectory
from megarl.rollout.engine_calls import Sampled
from megarl.rollout.seeds import SEGMENT_BITS, sequence_seed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class TurnSettings:
    model: str  # the name requests must send
    seed: int = 0  # the run's seed (trainer.seed)
    max_turn_tokens: int = 512  # new tokens of one reply (a request may ask for fewer)
    max_context_tokens: int = 4096  # one segment's prompt + everything after it
    # what may follow a segment's first prompt (model and tool tokens: the trained response), as
    # rollout.sampling.max_response_length bounds an environment's trajectory; None: only the context
    max_response_tokens: int | None = None
    tool_parser: str | None = "hermes"  # None: replies carry no tool_calls
    chat_template_kwargs: Mapping[str, object] = field(default_factory=dict)
    max_requests: int = 1 << SEGMENT_BITS  # per session: each draws its own seeded stream


class TurnMaker:
    """Answers the requests of sessions, recording what it samples in them."""

    def __init__(
        self,
        generator: Generator,
        tokenizer: PreTrainedTokenizerBase,
        settings: TurnSettings,
        rollout_index: int = 0,
    ) -> None:
        self.generator = generator
        self.tokenizer = tokenizer
        self.settings = settings
        self.rollout_index = rollout_index
        self.deltas = ChatDeltas(tokenizer, settings.chat_template_kwargs)
        self.vocab = len(tokenizer)
        self.parser: ToolParser | None = (
            TOOL_PARSERS.get(settings.tool_parser) if settings.tool_parser else None
        )

    # -- chat ----------------------------------------------------------------------------------
    def chat(self, session: Session, request: ChatRequest) -> Reply:
        """Answer a chat request in ``session`` (its lock held by the caller)."""
        tools_key = json.dumps(request.tools, sort_keys=True)
        segment = session.last
        added = chat_continuation(segment, request.messages, tools_key)
        self._refuse_huge(added if added is not None else [request.messages, request.tools])
        try:
            if segment is not None and added is not None:
                delta = self.deltas.env_ids(added, segment.stop_text, request.tools)
                context, prompt = segment.context + delta, None
            else:
                delta, prompt = [], self.deltas.prompt_ids(request.messages, request.tools)
                context = prompt
        except EnvError as e:  # the template cannot render these messages
            raise BadRequest("messages", str(e)) from None
        first = len(context) if prompt is not None or segment is None else segment.prompt_len
        sampled = self._sample(session, context, first, request.max_tokens)
        if prompt is not None or segment is None:
            segment = session.start(
                Segment(Trajectory(session.sample, list(context)), "chat", tools_key)
            )
        else:
            segment.trajectory.add_env_tokens(delta)
        reply, message = self._chat_reply(sampled, len(context), session)
        self._record(segment, sampled)
        segment.history = [message_key(m) for m in [*request.messages, message]]
        segment.trajectory.messages = [*request.messages, message]
        return reply

    def _chat_reply(
        self, sampled: Sampled, prompt_len: int, session: Session
    ) -> tuple[Reply, Message]:
        text = self._text(sampled)
        calls: list[dict[str, Any]] = []
        if self.parser is not None and self.settings.tool_parser is not None:
            parsed = parse_contained(self.parser, text)
            calls = [
                {
                    "id": f"call_{session.requests}_{j}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": dict(c.arguments)},
                }
                for j, c in enumerate(parsed.calls)
            ]
            if calls:
                text = text_without_calls(self.settings.tool_parser, text)
        finish = sampled.finish
        if calls and finish == "stop":
            finish = "tool_calls"
        reply = Reply(text, calls, finish, prompt_len, len(sampled.ids))
        message: Message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return reply, message

    # -- completions ---------------------------------------------------------------------------
    def completion(self, session: Session, request: CompletionRequest) -> Reply:
        """Answer a completions request in ``session`` (its lock held by the caller)."""
        segment = session.last
        added = completion_continuation(segment, request.prompt)
        self._refuse_huge(added if added is not None else request.prompt)
        if segment is not None and added is not None:
            delta = self._ids(added, special=False)
            context, new = segment.context + delta, False
        else:
            delta, context, new = [], self._ids(request.prompt, special=True), True
        first = len(context) if new or segment is None else segment.prompt_len
        sampled = self._sample(session, context, first, request.max_tokens)
        if new or segment is None:
            text = request.prompt if isinstance(request.prompt, str) else None
            segment = session.start(
                Segment(Trajectory(session.sample, list(context)), "completion", text=text)
            )
        else:
            segment.trajectory.add_env_tokens(delta)
        reply_text = self._text(sampled)
        self._record(segment, sampled)
        if isinstance(request.prompt, str):
            segment.text = request.prompt + reply_text
        return Reply(reply_text, [], sampled.finish, len(context), len(sampled.ids))

    def _ids(self, prompt: str | list[int], *, special: bool) -> list[int]:
        if isinstance(prompt, str):  # data: a spelling of a control token stays text
            return plain_text_ids(self.tokenizer, [prompt], add_special_tokens=special)[0]
        bad = [t for t in prompt if t >= self.vocab]
        if bad:
            raise BadRequest(
                "messages", f"token ids {bad[:5]} are past the tokenizer's {self.vocab} ids"
            )
        return list(prompt)

    # -- shared --------------------------------------------------------------------------------
    def _refuse_huge(self, value: object) -> None:
        """Refuse text that cannot fit the segment however it tokenizes, before any templating
        or tokenising (a huge request costs a length, not a tokenization)."""
        if isinstance(value, list) and all(isinstance(t, int) for t in value):
            chars = None if len(value) <= self.settings.max_context_tokens else len(value)
        else:
            chars = too_long(self.tokenizer, value, self.settings.max_context_tokens)
        if chars is not None:
            raise BadRequest(
                "context_length",
                f"the request adds {chars} characters (or ids), more than a segment of "
                f"{self.settings.max_context_tokens} tokens can hold",
            )

    def _sample(
        self, session: Session, context: Sequence[int], prompt_len: int, max_tokens: int | None
    ) -> Sampled:
        """One reply after ``context``, whose segment's first prompt is its ``prompt_len`` ids."""
        s = self.settings
        room = s.max_context_tokens - len(context)
        if room < 1:
            raise BadRequest(
                "context_length",
                f"the session's conversation is {len(context)} tokens; this endpoint's limit is "
                f"{s.max_context_tokens} tokens per segment, with room for at least one new token",
            )
        if s.max_response_tokens is not None:
            response = len(context) - prompt_len
            if response >= s.max_response_tokens:
                raise BadRequest(
                    "context_length",
                    f"the conversation holds {response} tokens after its first prompt; the run "
                    f"trains at most {s.max_response_tokens} (rollout.sampling.max_response_length), "
                    "with room for at least one new token",
                )
            room = min(room, s.max_response_tokens - response)
        if session.requests >= s.max_requests:
            raise BadRequest("requests", f"a session may send {s.max_requests} requests at most")
        limit = min(s.max_turn_tokens, room, max_tokens or s.max_turn_tokens)
        seed = sequence_seed(s.seed, self.rollout_index, session.sample, segment=session.requests)
        sampled = self.generator.sample(list(context), limit, seed)
        session.requests += 1
        return sampled

    def _record(self, segment: Segment, sampled: Sampled) -> None:
        segment.trajectory.add_model_turn(sampled.ids, sampled.logprobs, sampled.routes)
        segment.finish = sampled.finish
        stopped = sampled.finish == "stop" and bool(sampled.ids)
        segment.stop_text = self.tokenizer.decode(sampled.ids[-1:]) if stopped else None

    def _text(self, sampled: Sampled) -> str:
        """The reply's text: the sampled ids decoded, without the stop token that ended it."""
        ids = sampled.ids[:-1] if sampled.finish == "stop" else sampled.ids
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))
