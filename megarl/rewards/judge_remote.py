"""A judge at an OpenAI-compatible server (``reward.judge.url``), through the ``openai`` client.

Each prompt is one chat completion (one user message, greedy, at most ``reward.judge.max_tokens``
tokens), ``reward.judge.concurrency`` in flight at once; the client retries connection errors,
429 and 5xx ``reward.judge.retries`` times with its own backoff, and gives up on a request after
``reward.judge.timeout_s``. Before any model is built the server must list
``reward.judge.model`` among its models.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

import openai

from megarl.config import JudgeConfig
from megarl.errors import ConfigError
from megarl.rewards.judge import NoAnswer


class OpenAIJudge:
    """Answers from the model ``settings.model`` at ``settings.url``."""

    def __init__(self, settings: JudgeConfig) -> None:
        assert settings.url is not None and settings.model is not None
        self.url = settings.url
        self.model = settings.model
        self.settings = settings
        # a server without authentication takes any key; the client refuses none at all
        self.api_key = os.environ.get(settings.api_key_env) or "unused"

    @property
    def name(self) -> str:
        return f"the judge reward.judge.model={self.model} at reward.judge.url={self.url}"

    def _client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url,
            api_key=self.api_key,
            timeout=self.settings.timeout_s,
            max_retries=self.settings.retries,
        )

    async def _one(self, client: openai.AsyncOpenAI, prompt: str) -> str | NoAnswer:
        try:
            reply = await client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                temperature=0.0,
                max_tokens=self.settings.max_tokens,
            )
        except openai.APITimeoutError:
            return NoAnswer(
                "timeout", f"no answer within reward.judge.timeout_s={self.settings.timeout_s:g} s"
            )
        except openai.APIError as e:
            return NoAnswer("error", f"{type(e).__name__}: {e}")
        if not reply.choices:
            return NoAnswer("error", "the server's reply has no choices")
        return reply.choices[0].message.content or ""

    async def _all(self, prompts: Sequence[str]) -> list[str | NoAnswer]:
        slots = asyncio.Semaphore(self.settings.concurrency)
        async with self._client() as client:

            async def one(prompt: str) -> str | NoAnswer:
                async with slots:
                    return await self._one(client, prompt)

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    def answer(self, prompts: Sequence[str]) -> list[str | NoAnswer]:
        return asyncio.run(self._all(prompts)) if prompts else []

    async def _models(self) -> list[str]:
        async with self._client() as client:
            return [m.id async for m in client.models.list()]

    def check_reachable(self) -> None:
        """The server lists ``reward.judge.model``; a ConfigError naming the URL and the problem
        otherwise. Called before any model is built."""
        try:
            models = asyncio.run(self._models())
        except openai.APIError as e:
            raise ConfigError(
                f"reward.judge.url={self.url} does not answer GET {self.url.rstrip('/')}/models "
                f"({type(e).__name__}: {e}). Start the judge's OpenAI-compatible server (e.g. "
                "`vllm serve MODEL`), give its base URL ending in /v1, or unset reward.judge.url"
            ) from None
        if self.model not in models:
            raise ConfigError(
                f"reward.judge.model={self.model!r} is not served at reward.judge.url={self.url}; "
                f"it serves {models[:10]}"
            )
