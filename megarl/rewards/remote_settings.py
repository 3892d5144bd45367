"""``reward.remote_*``: where the remote reward service is and how it is called (checked by the
config's validation, :mod:`megarl.config.validation`)."""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config import RewardConfig


@dataclass(frozen=True)
class RemoteSettings:
    url: str
    batch_size: int = 64  # samples per request
    concurrency: int = 8  # requests in flight at once, per rank
    timeout_s: float = 60.0  # per request
    retries: int = 3  # on connection errors, 5xx and 429
    backoff_s: float = 0.5  # the first retry's wait; doubled for each next one

    @classmethod
    def from_config(cls, r: RewardConfig) -> RemoteSettings | None:
        """The settings of ``reward.remote_*``; None without a ``reward.remote_url``."""
        if r.remote_url is None:
            return None
        return cls(
            r.remote_url,
            r.remote_batch_size,
            r.remote_concurrency,
            r.remote_timeout_s,
            r.remote_retries,
            r.remote_backoff_s,
        )
