"""A dataset's batches without end: a new epoch starts when one ends."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from megarl.errors import ConfigError

T = TypeVar("T")


class EpochBatches(Generic[T]):
    """``next()`` gives this rank's next batch, starting the next epoch when one ends.

    A resumable dataset restores its position before the first ``next()`` (its iterator is made
    lazily). ``empty`` is the error message for a dataset that yields no batch at all.
    """

    def __init__(self, dataset: Iterable[T], empty: str) -> None:
        self.dataset = dataset
        self.empty = empty
        self._iter: Iterator[T] | None = None

    def next(self) -> T:
        for _ in range(2):
            if self._iter is None:
                self._iter = iter(self.dataset)
            try:
                return next(self._iter)
            except StopIteration:
                self._iter = None
        raise ConfigError(self.empty)
