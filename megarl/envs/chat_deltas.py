"""Environment messages as token ids: the chat template's delta, never re-tokenising earlier text.

A multi-turn trajectory is built from token ids only: the prompt (the template with the assistant
turn opened), each model turn exactly as sampled, and between them the tokens the template adds
for the environment's messages. That delta is rendered against a fixed stand-in conversation
(system, user, assistant), not the real one, so earlier text is never rendered or tokenised again
and what the model sampled is what the trainer scores:

- the model's turn ends with its stop token (e.g. ``<|im_end|>``); the template closes an
  assistant turn with more (``<|im_end|>\\n``): that gap is the delta's first part (a turn cut by
  its token limit gets the whole closing text);
- then the new messages as the template renders them after an assistant turn, and the next
  assistant turn opened (``<|im_start|>assistant\\n``).

The template must render a conversation's beginning the same whatever follows it, which holds for
the templates that put each message in its own block (ChatML: Qwen2.5 with its merged tool
responses, SmolLM2, Llama 3). One whose rendering of earlier messages changes (e.g. Qwen3 drops
past reasoning) still trains on exactly what was sampled, but no longer equals the template's
rendering of the whole conversation.

Message strings are data: a spelling of a control token in an environment's or a tool's message
stays text (megarl.data.literal_text), so only the template opens and closes turns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from megarl.data.chat import render_chats
from megarl.data.literal_text import Literals, spellings, tokenize_with_literals
from megarl.envs.base import EnvError, Message

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_S, _U, _A = "megarl-system-ffd3", "megarl-user-ffd3", "megarl-assistant-ffd3"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "megarl_probe_tool_ffd3",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}

Tools = Sequence[Mapping[str, object]] | None


class ChatDeltas:
    """Token ids of prompts and environment turns under one tokenizer's chat template."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self._bases: dict[str, tuple[list[Message], str, str]] = {}
        self.renders_tools = self._renders_tools()

    def _render(self, messages: list[Message], *, gen: bool, tools: Tools) -> str:
        kwargs = dict(self.kwargs)
        if tools:
            kwargs["tools"] = [dict(t) for t in tools]
        try:
            return render_chats(
                self.tokenizer, [messages], add_generation_prompt=gen, chat_template_kwargs=kwargs
            )[0]
        except EnvError:
            raise
        except Exception as e:  # jinja's raise_exception and template errors
            roles = [m.get("role") for m in messages]
            raise EnvError(
                f"the chat template cannot render a conversation with roles {roles}: "
                f"{type(e).__name__}: {e}"
            ) from e

    def _renders_tools(self) -> bool:
        plain = [{"role": "user", "content": _U}]
        try:
            with_tools = self._render(plain, gen=True, tools=[_PROBE_TOOL])
        except EnvError:
            return False
        return "megarl_probe_tool_ffd3" in with_tools

    def _base(self, tools: Tools) -> tuple[list[Message], str, str]:
        """The stand-in conversation, its rendering, and the closing text of its assistant turn."""
        key = repr(tools)
        if key not in self._bases:
            for base in (
                [
                    {"role": "system", "content": _S},
                    {"role": "user", "content": _U},
                    {"role": "assistant", "content": _A},
                ],
                [{"role": "user", "content": _U}, {"role": "assistant", "content": _A}],
            ):
                try:
                    opened = self._render(base[:-1], gen=True, tools=tools)
                    closed = self._render(base, gen=False, tools=tools)
                except EnvError:
                    continue
                if closed.startswith(opened + _A):
                    self._bases[key] = (base, closed, closed[len(opened) + len(_A) :])
                    break
            else:
                raise EnvError(
                    "the chat template does not render an assistant turn as the text after its "
                    "opened turn (<generation prompt> + content + end of turn), so environment "
                    "messages cannot be appended as token deltas; use a template that does"
                )
        return self._bases[key]

    def prompt_ids(self, messages: list[Message], tools: Tools = None) -> list[int]:
        """The conversation with the assistant turn opened, as token ids."""
        literals = Literals(spellings(self.tokenizer))
        hidden = literals.hide_messages(messages)
        # tool schemas are data too (an agent's, or an environment's): their strings stay text
        hidden_tools = literals.hide_value(list(tools)) if tools else tools
        text = self._render(hidden, gen=True, tools=hidden_tools)
        _check_rendered(hidden, text)
        return tokenize_with_literals(self.tokenizer, [text], [literals])[0]

    def turn_close(self, stop_text: str | None, tools: Tools = None) -> str:
        """What the template writes after an assistant turn's content that the model did not
        sample: after its stop token's text, or (``None``: the turn was cut) all of it."""
        tail = self._base(tools)[2]
        if stop_text and tail.startswith(stop_text):
            return tail[len(stop_text) :]
        return tail

    def env_ids(
        self,
        messages: list[Message],
        stop_text: str | None,
        tools: Tools = None,
        open_next: bool = True,
    ) -> list[int]:
        """Tokens after a model turn: its closing text, ``messages`` as the template renders them
        after an assistant turn, and (``open_next``) the next assistant turn opened."""
        base, closed, _ = self._base(tools)
        literals = Literals(spellings(self.tokenizer))
        messages = literals.hide_messages(messages)
        full = self._render(base + messages, gen=open_next, tools=tools)
        if not full.startswith(closed):
            raise EnvError(
                "the chat template renders an assistant turn differently once messages follow "
                f"it ({closed[-40:]!r} vs {full[len(closed) - 40 : len(closed)]!r}), so "
                "environment messages cannot be appended as token deltas"
            )
        delta = full[len(closed) :]
        _check_rendered(messages, delta)
        text = self.turn_close(stop_text, tools) + delta
        return tokenize_with_literals(self.tokenizer, [text], [literals])[0]


def _check_rendered(messages: Sequence[Message], text: str) -> None:
    """Every message's content shows in the rendered text, in order (a template that silently
    drops an unknown role fails here)."""
    at = 0
    for m in messages:
        content = m["content"]
        found = text.find(content, at) if content else at
        if found < 0:
            raise EnvError(
                f"the chat template does not render a message of role {m['role']!r} (its content "
                f"is missing from the rendered text); use roles the template knows (user, tool)"
            )
        at = found + len(content)
