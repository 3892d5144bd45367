"""The OpenAI-compatible agent endpoint: an HTTP server on loopback, one session per sample.

Routes (``KEY``: the session's key, an unguessable token the runner puts in the agent's base
URL ``http://127.0.0.1:PORT/s/KEY/v1``):

- ``POST /s/KEY/v1/chat/completions``: messages, tools and tool calls in OpenAI's format;
- ``POST /s/KEY/v1/completions``: a prompt (text, or token ids);
- ``GET /s/KEY/v1/models``: the one model served.

A refused request gets an OpenAI-style JSON error (HTTP 400; 404 for an unknown session or
route, 409 for a closed one) and is counted by reason (:data:`megarl.agents.openai_format.REASONS`).
The server is the standard library's threading HTTP server on 127.0.0.1 only; each request runs
in its own thread; the generator batches the requests of concurrent sessions into engine calls.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from megarl.agents.generation import Generator
from megarl.agents.openai_format import (
    BadRequest,
    chat_response,
    completion_response,
    models_response,
    parse_chat,
    parse_completion,
    parse_json,
)
from megarl.agents.session import Session
from megarl.agents.turns import TurnMaker, TurnSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_BODY_BYTES = 64 << 20
HOST = "127.0.0.1"
Response = tuple[int, dict[str, Any]]


class AgentEndpoint:
    """Sessions, their turns and the HTTP server that reaches them. ``start()`` binds a free
    loopback port; ``open_session``/``close_session`` bracket one sample's agent."""

    def __init__(
        self,
        generator: Generator,
        tokenizer: PreTrainedTokenizerBase,
        settings: TurnSettings,
        rollout_index: int = 0,
    ) -> None:
        self.settings = settings
        self.turns = TurnMaker(generator, tokenizer, settings, rollout_index)
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- the server ----------------------------------------------------------------------------
    def start(self) -> AgentEndpoint:
        handler = _handler_for(self.handle)
        self._server = _Server((HOST, 0), handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="megarl-agent-endpoint", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> AgentEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the agent endpoint is not started; call start()")
        return f"http://{HOST}:{self._server.server_address[1]}"

    # -- sessions ------------------------------------------------------------------------------
    def open_session(self, sample: int) -> tuple[str, str]:
        """A new session for ``sample``: its key and the base URL its agent is given."""
        key = secrets.token_urlsafe(16)
        with self._lock:
            self._sessions[key] = Session(key, sample)
        return key, f"{self.url}/s/{key}/v1"

    def close_session(self, key: str) -> Session:
        """End a session (waiting for a request in flight): later requests get HTTP 409."""
        with self._lock:
            session = self._sessions[key]
        with session.lock:
            session.closed = True
        return session

    def forget(self, key: str) -> None:
        with self._lock:
            self._sessions.pop(key, None)

    def take_counts(self) -> dict[str, int]:
        """The counters since the last call (refused requests by reason, ignored parameters)."""
        with self._lock:
            counts = dict(self._counts)
            self._counts.clear()
        return counts

    def _count(self, name: str, by: int = 1) -> None:
        if by:
            with self._lock:
                self._counts[name] += by

    # -- requests ------------------------------------------------------------------------------
    def handle(self, method: str, path: str, body: bytes) -> Response:
        """The status and JSON body answering one HTTP request."""
        try:
            return 200, self._route(method, path, body)
        except BadRequest as e:
            self._count(f"bad_requests/{e.reason}")
            return e.status, e.body()
        except Exception as e:  # the engine or the tokenizer failed: the agent sees a 500
            self._count("server_errors")
            error = {"message": f"{type(e).__name__}: {str(e)[:300]}", "type": "server_error"}
            return 500, {"error": error}

    def _route(self, method: str, path: str, body: bytes) -> dict[str, Any]:
        parts = path.split("?", 1)[0].strip("/").split("/")
        if len(parts) < 4 or parts[0] != "s" or parts[2] != "v1":
            raise BadRequest("path", f"no route {method} {path[:80]}; use /s/KEY/v1/...", 404)
        with self._lock:
            session = self._sessions.get(parts[1])
        if session is None:
            raise BadRequest(
                "session", "unknown session; use the base URL the agent was given", 404
            )
        route = "/".join(parts[3:])
        model = self.settings.model
        if method == "GET" and route == "models":
            return models_response(model)
        if method != "POST" or route not in ("chat/completions", "completions"):
            raise BadRequest("path", f"no route {method} /v1/{route[:60]}", 404)
        request_id = f"{session.sample}-{session.requests}"
        payload = parse_json(body)
        with session.lock:
            if session.closed:
                raise BadRequest(
                    "session", "this sample's session is closed (its time ran out)", 409
                )
            if route == "chat/completions":
                chat = parse_chat(payload, model)
                self._count("ignored_params", len(chat.ignored))
                return chat_response(self.turns.chat(session, chat), model, request_id)
            completion = parse_completion(payload, model)
            self._count("ignored_params", len(completion.ignored))
            return completion_response(
                self.turns.completion(session, completion), model, request_id
            )


class _Server(ThreadingHTTPServer):
    """The standard library's threading server, with a listen backlog for many agents connecting
    at once (its default of 5 drops connections: the clients see them reset)."""

    daemon_threads = True
    request_queue_size = 1024


def _handler_for(handle: Callable[[str, str, bytes], Response]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # a reply's headers and body leave at once, not after the client's delayed ACK (~20 ms)
        disable_nagle_algorithm = True

        def _answer(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                status, out = 413, BadRequest("bad_json", "the request body is too large").body()
                self.close_connection = True
            else:
                body = self.rfile.read(length) if length else b""
                status, out = handle(method, self.path, body)
            data = json.dumps(out, ensure_ascii=False).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def log_message(self, format: str, *args: object) -> None:
            """Quiet: the endpoint counts what matters."""

    return Handler
