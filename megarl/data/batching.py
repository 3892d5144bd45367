"""Fixed-size, lockstep batches over one rank's shard, with a resumable position.

Every rank delivers the same number of batches per epoch (`steps_per_epoch`, computed from file
footers alone), because data-parallel ranks meet in collectives every step. Rows the encoder
drops (e.g. overlong prompts) are replaced by the next rows of the rank's share; a rank that runs
out refills from the start of its own share, and counts those rows as `refilled`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any, Generic, TypeVar

from megarl.data.errors import DataError
from megarl.data.shard_reader import ShardReader
from megarl.data.sharding import steps_per_epoch
from megarl.data.state import DataState

T = TypeVar("T")
Rows = Sequence[tuple[int, dict[str, Any]]]


class ShardBatches(Generic[T]):
    """Batches of `encode`d rows; `encode` returns one item per row, or None to drop that row."""

    def __init__(
        self,
        reader: ShardReader,
        encode: Callable[[Rows], list[T | None]],
        *,
        kind: str,
        batch_size: int,
        drop_last: bool,
        fingerprint: str,
    ) -> None:
        if batch_size < 1:
            raise DataError(f"batch_size_per_rank must be >= 1, got {batch_size}.")
        self.reader = reader
        self.encode = encode
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.steps_per_epoch = steps_per_epoch(
            reader.total_rows, reader.dp_size, batch_size, drop_last
        )
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the data has {reader.total_rows} rows: too few for {reader.dp_size} "
                f"data-parallel ranks x {batch_size} rows per batch; add data or lower the "
                "batch size."
            )
        self.state = DataState(
            kind=kind,
            seed=reader.seed,
            epoch=0,
            step=0,
            cursor=0,
            dp_rank=reader.dp_rank,
            dp_size=reader.dp_size,
            batch_size_per_rank=batch_size,
            fingerprint=fingerprint,
            counters={"dropped": 0, "refilled": 0},
        )
        self._generation = 0

    def state_dict(self) -> dict[str, Any]:
        return self.state.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state; call before iterating (a live iterator then refuses to go on)."""
        saved = DataState.from_dict(state)
        saved.check_resumable(self.state)
        # An epoch-boundary state may come from another layout: keep this rank's own layout.
        saved.dp_rank, saved.dp_size = self.state.dp_rank, self.state.dp_size
        saved.batch_size_per_rank = self.batch_size
        saved.counters = {**self.state.counters, **saved.counters}
        self.state = saved
        self.reader.set_seed(saved.seed)
        self._generation += 1

    def _rows(self, epoch: int, cursor: int) -> Iterator[tuple[int, dict[str, Any]]]:
        share = self.reader.share_rows(epoch)
        if not self.drop_last:
            if cursor < share:
                yield from self.reader.iter_rows(epoch, cursor)
            return
        position = cursor % share
        while True:
            yield from self.reader.iter_rows(epoch, position)
            position = 0

    def __iter__(self) -> Iterator[list[T]]:
        """The remaining batches of the current epoch; afterwards the state points at the next one."""
        generation = self._generation
        st = self.state
        share = self.reader.share_rows(st.epoch)
        rows = self._rows(st.epoch, st.cursor)
        while st.step < self.steps_per_epoch:
            batch: list[T] = []
            since_kept = 0
            while len(batch) < self.batch_size:
                chunk = list(islice(rows, self.batch_size - len(batch)))
                if not chunk:
                    break
                items = self.encode(chunk)
                for i, item in enumerate(items):
                    if item is None:
                        st.counters["dropped"] += 1
                        since_kept += 1
                    else:
                        batch.append(item)
                        since_kept = 0
                        if st.cursor + i >= share:
                            st.counters["refilled"] += 1
                st.cursor += len(chunk)
                if since_kept > share:
                    raise DataError(
                        f"every row of data-parallel rank {st.dp_rank}'s share ({share} rows) "
                        "was dropped; loosen the length limits or check the data."
                    )
            st.step += 1
            if st.step == self.steps_per_epoch:
                st.epoch, st.step, st.cursor = st.epoch + 1, 0, 0
            yield batch
            if self._generation != generation:
                raise RuntimeError("load_state_dict() was called while iterating; iterate again.")
            if st.step == 0:
                return
