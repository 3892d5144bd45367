"""Scores from a remote reward service (``reward.remote_url``), over HTTP with aiohttp.

Each call POSTs the samples in batches of ``batch_size``, at most ``concurrency`` requests at a
time, each within ``timeout_s``; a connection error, an HTTP 5xx or 429 is retried ``retries``
times, waiting ``backoff_s``, then twice as long each time. A batch that still has no good answer
(retries spent, another HTTP status, a bad answer, a timeout: timeouts are not retried) gives each
of its samples score 0 and one failure, which the run counts like a local scorer's
(``reward.max_failed_fraction``). The wire format is :mod:`megarl.rewards.remote_protocol`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from megarl.errors import ConfigError
from megarl.rewards.failures import ScoredBatch, report_failures
from megarl.rewards.manager import RewardSample
from megarl.rewards.remote_protocol import (
    BadAnswer,
    RemoteScore,
    parse_answer,
    request_body,
    shown,
)
from megarl.rewards.remote_settings import RemoteSettings
from megarl.rewards.scoring import ScoreOutcome, Status
from megarl.rewards.shares import remote_extra_count, remote_extra_mean

logger = logging.getLogger(__name__)

T = TypeVar("T")
JSON_HEADERS = {"Content-Type": "application/json"}
RETRIED_STATUSES = frozenset({429})  # besides every 5xx


@dataclass(frozen=True)
class Answer:
    """How one request went: its scores, or why it has none; and how often it was retried."""

    scores: list[RemoteScore] | None
    status: Status
    message: str = ""
    retries: int = 0


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """``coro`` on an event loop of its own (the caller's thread's current loop is left alone)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


class RemoteScorer:
    """Scores samples with the service at ``settings.url``; see the module docstring."""

    def __init__(self, settings: RemoteSettings, *, strict: bool = False) -> None:
        self.settings = settings
        self.strict = strict
        self.totals: dict[str, int] = defaultdict(int)

    @property
    def name(self) -> str:
        """The service as a user would name it."""
        return f"the remote reward service reward.remote_url={self.settings.url}"

    def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s),
            connector=aiohttp.TCPConnector(limit=self.settings.concurrency),
        )

    async def _post(self, session: aiohttp.ClientSession, body: bytes, expected: int) -> Answer:
        """One batch's request, retried on connection errors, 5xx and 429."""
        s = self.settings
        retries = 0
        while True:
            try:
                async with session.post(s.url, data=body, headers=JSON_HEADERS) as response:
                    status, text = response.status, await response.read()
            except TimeoutError:
                return Answer(
                    None,
                    "timeout",
                    f"no answer within reward.remote_timeout_s={s.timeout_s:g} s",
                    retries,
                )
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                problem = f"{type(e).__name__}: {e}"
            except aiohttp.ClientError as e:
                return Answer(None, "error", f"{type(e).__name__}: {e}", retries)
            else:
                if status >= 500 or status in RETRIED_STATUSES:
                    problem = f"HTTP {status}: {shown(text)}"
                elif not 200 <= status < 300:
                    return Answer(None, "error", f"HTTP {status}: {shown(text)}", retries)
                else:
                    try:
                        return Answer(parse_answer(text, expected), "ok", retries=retries)
                    except BadAnswer as e:
                        return Answer(None, "error", str(e), retries)
            if retries >= s.retries:
                return Answer(None, "error", f"{problem} (after {retries} retries)", retries)
            await asyncio.sleep(s.backoff_s * 2**retries)
            retries += 1

    async def _post_all(self, bodies: Sequence[tuple[bytes, int]]) -> list[Answer]:
        slots = asyncio.Semaphore(self.settings.concurrency)
        async with self._session() as session:

            async def one(body: bytes, expected: int) -> Answer:
                async with slots:
                    return await self._post(session, body, expected)

            return list(await asyncio.gather(*(one(b, n) for b, n in bodies)))

    def check_reachable(self) -> None:
        """POST an empty batch; a ConfigError naming the URL and what went wrong unless the
        service answers ``{"scores": []}`` (after the retries). Called before any model is built."""
        answer = _run(self._post_all([(request_body([]), 0)]))[0]
        if answer.status != "ok":
            raise ConfigError(
                f"reward.remote_url={self.settings.url} does not answer an empty batch with "
                f'{{"scores": []}}: {answer.message}. Start the reward service (its protocol: '
                "docs/rewards.md) or unset reward.remote_url"
            )

    def score(self, samples: Sequence[RewardSample]) -> ScoredBatch:
        """Every sample's score, in order; see the module docstring for failures. Metrics:
        reward/remote_samples, reward/remote_mean, reward/remote_failures,
        reward/remote_timeouts, reward/remote_retries, and for each extra metric the service
        returned reward/remote/<name> (the mean over the samples that returned it) and
        reward/remote_samples/<name> (how many did). How each
        combines over data-parallel ranks: :mod:`megarl.rewards.shares`."""
        size = self.settings.batch_size
        starts = range(0, len(samples), size)
        bodies = [(request_body(samples[i : i + size]), len(samples[i : i + size])) for i in starts]
        answers = _run(self._post_all(bodies)) if bodies else []
        scores = [0.0] * len(samples)
        failures: list[ScoreOutcome] = []
        extra: dict[str, list[float]] = defaultdict(list)
        for start, answer in zip(starts, answers, strict=True):
            stop = min(start + size, len(samples))
            if answer.scores is None:
                failures += [
                    ScoreOutcome(i, answer.status, 0.0, answer.message) for i in range(start, stop)
                ]
                continue
            for i, entry in zip(range(start, stop), answer.scores, strict=True):
                scores[i] = entry.score
                for name, value in entry.metrics.items():
                    extra[name].append(value)
        if failures:
            self._report(len(samples), failures)
        n = max(len(samples), 1)
        metrics = {
            "reward/remote_samples": float(len(samples)),
            "reward/remote_mean": sum(scores) / n,
            "reward/remote_failures": float(len(failures)),
            "reward/remote_timeouts": float(sum(f.status == "timeout" for f in failures)),
            "reward/remote_retries": float(sum(a.retries for a in answers)),
        }
        for name, values in sorted(extra.items()):
            metrics[remote_extra_mean(name)] = sum(values) / len(values)
            metrics[remote_extra_count(name)] = float(len(values))
        return ScoredBatch(scores, metrics, failures)

    def _report(self, total: int, failures: list[ScoreOutcome]) -> None:
        """The failed samples of a call, once, with the first bad answer."""
        timeouts = sum(f.status == "timeout" for f in failures)
        self.totals["failures"] += len(failures)
        self.totals["timeouts"] += timeouts
        report_failures(logger, self.name, self.strict, total, failures, f" ({timeouts} timeouts)")
