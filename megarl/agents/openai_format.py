"""OpenAI's request and response formats, as the agent endpoint reads and writes them.

Requests are hostile input: whatever an agent sends is checked here and turned into plain typed
values, or refused with a :class:`BadRequest` whose ``reason`` (one of :data:`REASONS`) is what
the endpoint counts. Messages come out *normalised*: string content (text parts joined, None as
""), an assistant's ``tool_calls`` with their arguments decoded to objects (what chat templates
render), only the fields a template reads. Two requests' histories are compared in that form
(:func:`message_key`), so a client that echoes a reply with extra null fields still continues it.

Sampling parameters are the run's: ``max_tokens`` (or ``max_completion_tokens``) may lower a
reply's token limit; ``temperature``, ``top_p``, ``seed``, ``stop`` and the like are ignored and
counted (:attr:`ChatRequest.ignored`), never applied, so every token is sampled from the policy
as the trainer assumes.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")
# why a request was refused: the endpoint counts each (agent/bad_requests/<reason>)
REASONS = (
    "bad_json",  # the body is not a JSON object
    "model",  # another model name than the one served
    "role",  # a message of a role other than ROLES
    "messages",  # a malformed message list (missing, empty, content of an unsupported type)
    "tools",  # a malformed tools schema
    "max_tokens",  # not a positive integer
    "unsupported",  # stream, n > 1, echo, best_of, suffix
    "context_length",  # the session's token budget has no room for the request
    "requests",  # the session has sent as many requests as it may (each draws its own seed)
    "session",  # an unknown or closed session
    "path",  # no such route
)
IGNORED = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "tool_choice",
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
)
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class BadRequest(Exception):
    """A request the endpoint refuses: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, reason: str, message: str, status: int = 400) -> None:
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.status = status

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": None,
                "code": self.reason,
            }
        }


@dataclass(frozen=True)
class ChatRequest:
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    ignored: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    max_tokens: int | None
    ignored: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reply:
    """What the endpoint answers one request with (ids are the sampled ones, text decoded)."""

    text: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = "stop"  # stop | length | tool_calls
    prompt_tokens: int = 0
    completion_tokens: int = 0


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BadRequest("bad_json", f"the request body is not JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise BadRequest("bad_json", f"the request body must be a JSON object, got {body!r:.80}")
    return body


def _check_common(body: Mapping[str, Any], served: str) -> tuple[int | None, tuple[str, ...]]:
    model = body.get("model")
    if model != served:
        raise BadRequest(
            "model",
            f"this endpoint serves the model {served!r} only; the request asks for {model!r:.80}",
        )
    if body.get("stream"):
        raise BadRequest("unsupported", "stream=true is not supported; send stream=false")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise BadRequest(
            "unsupported", f"n={n!r:.20}: one choice per request (each request is one model turn)"
        )
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise BadRequest("max_tokens", f"max_tokens must be a positive integer, got {limit!r:.40}")
    ignored = tuple(k for k in IGNORED if body.get(k) is not None)
    return limit, ignored


def _content(value: object, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise BadRequest(
                    "messages", f"{where}: only text content parts are supported, got {part!r:.80}"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest("messages", f"{where}: a text part needs a string 'text'")
            parts.append(text)
        return "".join(parts)
    raise BadRequest("messages", f"{where}: content must be a string, got {value!r:.80}")


def _arguments(value: object, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except (ValueError, RecursionError):
            raise BadRequest(
                "messages", f"{where}: the arguments are not JSON: {value!r:.80}"
            ) from None
    if not isinstance(value, dict):
        raise BadRequest(
            "messages", f"{where}: the arguments must be a JSON object, got {value!r:.80}"
        )
    return value


def _tool_calls(value: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise BadRequest("messages", f"{where}: tool_calls must be a list, got {value!r:.80}")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}, tool call {j}"
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise BadRequest("messages", f"{at}: needs function.name, got {call!r:.80}")
        assert isinstance(function, Mapping)
        calls.append(
            {
                "id": str(call.get("id") or f"call_{j}"),
                "type": "function",
                "function": {"name": name, "arguments": _arguments(function.get("arguments"), at)},
            }
        )
    return calls


def normalise_message(m: object, i: int) -> Message:
    """One request message as the templates read it, or a BadRequest."""
    where = f"message {i}"
    if not isinstance(m, Mapping):
        raise BadRequest("messages", f"{where} is {type(m).__name__}, not an object")
    role = m.get("role")
    if role not in ROLES:
        raise BadRequest("role", f"{where} has role {role!r:.40}; the roles are {', '.join(ROLES)}")
    out: Message = {"role": role, "content": _content(m.get("content"), where)}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = _tool_calls(m["tool_calls"], where)
    if role == "tool" and m.get("tool_call_id") is not None:
        out["tool_call_id"] = str(m["tool_call_id"])
    if m.get("name") is not None and role != "assistant":
        out["name"] = str(m["name"])
    return out


def message_key(m: Message) -> str:
    """The form two histories are compared in: every field but the tool calls' ids."""
    plain = dict(m)
    if "tool_calls" in plain:
        plain["tool_calls"] = [c["function"] for c in plain["tool_calls"]]
    return json.dumps(plain, sort_keys=True, ensure_ascii=False)


def check_tools(value: object) -> list[dict[str, Any]] | None:
    """A request's ``tools``: None or a list of function schemas, else a BadRequest."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadRequest("tools", f"tools must be a list of function schemas, got {value!r:.80}")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise BadRequest(
                "tools", f'{where} must be {{"type": "function", "function": {{...}}}}'
            )
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise BadRequest("tools", f"{where}.function must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise BadRequest(
                "tools",
                f"{where}.function.name must be 1-64 letters, digits, _ . or -, got {name!r:.80}",
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequest("tools", f"{where}.function.description must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not (
            isinstance(parameters, Mapping) and parameters.get("type", "object") == "object"
        ):
            raise BadRequest(
                "tools",
                f'{where}.function.parameters must be a JSON schema {{"type": "object", ...}}',
            )
        tools.append({"type": "function", "function": dict(function)})
    return tools or None


def parse_chat(body: Mapping[str, Any], served: str) -> ChatRequest:
    limit, ignored = _check_common(body, served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "messages must be a non-empty list of chat messages")
    normal = [normalise_message(m, i) for i, m in enumerate(messages)]
    return ChatRequest(normal, check_tools(body.get("tools")), limit, ignored)


def parse_completion(body: Mapping[str, Any], served: str) -> CompletionRequest:
    limit, ignored = _check_common(body, served)
    for key in ("echo", "suffix"):
        if body.get(key):
            raise BadRequest("unsupported", f"{key} is not supported")
    if body.get("best_of") not in (None, 1):
        raise BadRequest("unsupported", "best_of is not supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return CompletionRequest(list(prompt), limit, ignored)
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest(
            "messages", "prompt must be a non-empty string or list of token ids (one prompt)"
        )
    return CompletionRequest(prompt, limit, ignored)


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def chat_response(reply: Reply, model: str, request_id: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                },
            }
            for c in reply.tool_calls
        ]
        message["content"] = reply.text or None
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}
        ],
        "usage": _usage(reply),
    }


def completion_response(reply: Reply, model: str, request_id: str) -> dict[str, Any]:
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "text": reply.text, "finish_reason": reply.finish_reason, "logprobs": None}
        ],
        "usage": _usage(reply),
    }


def models_response(model: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "megarl"}],
    }
