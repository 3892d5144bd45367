"""Runs the environments of many samples on one process: their resets, then each turn's steps,
all of a turn's concurrently (``async def step`` on one event loop, plain ``step`` in the tool
pool's threads), and turns what they return into token ids.

Each sample gets its own instance, seeded from the run's seed, the rollout's index and the
sample's index in the step (:func:`env_seed`), so a trajectory does not depend on which rank runs
it. An environment that raises or breaks the API fails its sample only: the sample ends with
finish reason ``error`` (reward 0), and the error is kept to be counted and shown.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from megarl.data.literal_text import too_long
from megarl.envs.base import (
    EnvContext,
    EnvError,
    Environment,
    Message,
    Step,
    bind_context,
    check_reset,
    check_step,
)
from megarl.envs.chat_deltas import ChatDeltas
from megarl.envs.loading import make_environment
from megarl.envs.pool import ToolPool


def env_seed(run_seed: int, rollout_index: int, sample: int) -> int:
    """A 63-bit seed from the run's seed, the rollout's index and the sample's global index."""
    state = np.random.SeedSequence([run_seed, rollout_index, sample]).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


@dataclass
class Started:
    """A reset sample: its instance, its conversation and the prompt's ids (or its failure)."""

    env: Environment | None
    messages: list[Message]
    prompt_ids: list[int]
    tools: list[dict[str, object]] | None = None
    error: str | None = None


@dataclass
class Stepped:
    """One sample's answer to a model turn: the step and the tokens of its messages."""

    step: Step | None
    env_ids: list[int] = field(default_factory=list)
    error: str | None = None


def _failure(where: str, e: BaseException) -> str:
    if isinstance(e, EnvError):
        return str(e)
    frames = traceback.format_exception(type(e), e, e.__traceback__)
    return f"{where} raised {type(e).__name__}: {e}\n" + "".join(frames[-3:]).rstrip()


class EnvRunner:
    def __init__(
        self,
        env_cls: type[Environment],
        env_kwargs: Mapping[str, object],
        deltas: ChatDeltas,
        pool: ToolPool,
        run_seed: int,
        stop_token_ids: Iterable[int],
        max_prompt_tokens: int,
    ) -> None:
        self.env_cls = env_cls
        self.env_kwargs = dict(env_kwargs)
        self.deltas = deltas
        self.tokenizer = deltas.tokenizer
        self.pool = pool
        self.run_seed = run_seed
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.max_prompt_tokens = max_prompt_tokens
        self.loop = asyncio.new_event_loop()
        self.env_seconds = 0.0  # wall time spent in resets and steps, since the last reading

    def _tools(self, env: Environment) -> list[dict[str, object]] | None:
        schemas = env.tool_schemas()
        return list(schemas) if schemas and self.deltas.renders_tools else None

    # -- resets --------------------------------------------------------------------------------
    def _reset_one(self, sample: int, row: dict[str, object], rollout_index: int) -> Started:
        where = f"{self.env_cls.__qualname__}"
        try:
            env = make_environment(self.env_cls, self.env_kwargs)
            seed = env_seed(self.run_seed, rollout_index, sample)
            bind_context(
                env,
                EnvContext(
                    seed=seed,
                    rng=random.Random(seed),
                    pool=self.pool,
                    template_renders_tools=self.deltas.renders_tools,
                    sample_index=sample,
                ),
            )
            messages = check_reset(env, env.reset(dict(row)))
            chars = too_long(self.tokenizer, messages, self.max_prompt_tokens)
            if chars is not None:  # refused before any templating: a huge text costs a length
                raise EnvError(
                    f"{where}.reset gives a prompt of {chars:,} characters, more than "
                    f"data.max_prompt_length={self.max_prompt_tokens} tokens can ever hold; "
                    "raise it or shorten the environment's first messages"
                )
            tools = self._tools(env)
            ids = self.deltas.prompt_ids(messages, tools)
        except Exception as e:
            return Started(None, [], [], error=_failure(f"{where}.reset", e))
        if len(ids) > self.max_prompt_tokens:
            return Started(
                None,
                messages,
                [],
                error=(
                    f"{where}.reset gives a prompt of {len(ids)} tokens, more than "
                    f"data.max_prompt_length={self.max_prompt_tokens}; raise it or shorten the "
                    "environment's first messages"
                ),
            )
        return Started(env, messages, ids, tools)

    def reset_all(
        self, samples: Sequence[tuple[int, dict[str, object]]], rollout_index: int
    ) -> list[Started]:
        t0 = time.perf_counter()
        out = [self._reset_one(s, row, rollout_index) for s, row in samples]
        self.env_seconds += time.perf_counter() - t0
        return out

    # -- steps ---------------------------------------------------------------------------------
    def model_message(self, ids: Sequence[int]) -> tuple[Message, str | None]:
        """The model's turn as an assistant message, and its stop token's text (None: the turn
        was cut before one)."""
        ids = list(ids)
        stop_text = None
        if ids and ids[-1] in self.stop_token_ids:
            stop_text = self.tokenizer.decode(ids[-1:])
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return {"role": "assistant", "content": text}, stop_text

    async def _step_one(self, started: Started, stop_text: str | None, open_next: bool) -> Stepped:
        env = started.env
        assert env is not None
        where = f"{self.env_cls.__qualname__}.step"
        try:
            messages = list(started.messages)
            if inspect.iscoroutinefunction(env.step):
                raw = await env.step(messages)
            else:
                raw = await self.pool.in_thread(env.step, messages)
            step = check_step(env, raw)
            ids: list[int] = []
            if not step.done and open_next:
                ids = self.deltas.env_ids(step.messages, stop_text, started.tools)
            return Stepped(step, ids)
        except Exception as e:
            return Stepped(None, error=_failure(where, e))

    async def step(self, started: Started, ids: Sequence[int], open_next: bool) -> Stepped:
        """Append the model's turn (its sampled ids) to ``started``'s conversation, step its
        environment and append the environment's messages; ``open_next``: another model turn
        may follow (else no delta is made). Never raises for the environment's faults."""
        message, stop_text = self.model_message(ids)
        started.messages.append(message)
        result = await self._step_one(started, stop_text, open_next)
        if result.step is not None:
            started.messages += result.step.messages
        return result

    def step_all(self, items: Sequence[tuple[Started, Sequence[int], bool]]) -> list[Stepped]:
        """:meth:`step` for every ``(started, ids, open_next)``, all concurrently; the wall
        seconds count in :meth:`take_seconds`."""

        async def gather():
            return await asyncio.gather(*(self.step(*item) for item in items))

        t0 = time.perf_counter()
        out = list(self.loop.run_until_complete(gather()))
        self.add_seconds(time.perf_counter() - t0)
        return out

    def add_seconds(self, seconds: float) -> None:
        """Count ``seconds`` of waiting on environments (read by :meth:`take_seconds`)."""
        self.env_seconds += seconds

    def take_seconds(self) -> float:
        seconds, self.env_seconds = self.env_seconds, 0.0
        return seconds

    def close(self) -> None:
        self.pool.close()
        self.loop.close()
