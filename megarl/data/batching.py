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
from megarl.data.global_state import global_state, is_global
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
        # While finishing an epoch planned at another data-parallel size: (old dp size, the old
        # ranks' batches this rank takes from, slice [lo, hi) of their concatenated batch).
        self._remainder: tuple[int, list[ShardBatches[T]], int, int] | None = None

    def state_dict(self) -> dict[str, object]:
        if self._remainder is not None:
            old_dp, parts, _, _ = self._remainder
            return global_state(old_dp, [p.state.to_dict() for p in parts])
        return self.state.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state; call before iterating (a live iterator then refuses to go on).

        ``state``: this rank's own state, or a global record (:mod:`megarl.data.global_state`)
        saved at any data-parallel size.
        """
        self._remainder = None
        if is_global(state):
            ranks = [DataState.from_dict(r) for r in state["ranks"]]
            if int(state["dp_size"]) == self.state.dp_size:
                state = ranks[self.state.dp_rank].to_dict()
            elif all(r.at_epoch_start for r in ranks):
                state = ranks[0].to_dict()
            else:
                self._finish_epoch_of(int(state["dp_size"]), ranks)
                return
        saved = DataState.from_dict(state)
        saved.check_resumable(self.state)
        # An epoch-boundary state may come from another layout: keep this rank's own layout.
        saved.dp_rank, saved.dp_size = self.state.dp_rank, self.state.dp_size
        saved.batch_size_per_rank = self.batch_size
        saved.counters = {**self.state.counters, **saved.counters}
        self.state = saved
        self.reader.set_seed(saved.seed)
        self._generation += 1

    def _finish_epoch_of(self, old_dp: int, ranks: list[DataState]) -> None:
        """Serve the rest of an epoch planned for ``old_dp`` ranks in that layout's order."""
        first = ranks[0]
        cur = self.state
        if first.kind != cur.kind or first.fingerprint != cur.fingerprint:
            first.check_resumable(cur)  # raises the data-mismatch error
        if not self.drop_last:
            raise DataError(
                "a mid-epoch position of another data-parallel size can only be resumed with "
                "drop_last batches; resume with the same data-parallel size"
            )
        old_b = first.batch_size_per_rank
        total = old_dp * old_b
        if total != cur.dp_size * self.batch_size:
            raise DataError(
                f"the data position was saved with a global batch of {total} rows "
                f"({old_dp} ranks x {old_b}), now {cur.dp_size} x {self.batch_size}; resume with "
                "the same global batch size (data.train_batch_size)"
            )
        if len({(r.epoch, r.step) for r in ranks}) != 1:
            raise DataError("the saved data states of the data-parallel ranks disagree; damaged")
        lo = cur.dp_rank * self.batch_size
        hi = lo + self.batch_size
        first_rank, last_rank = lo // old_b, (hi - 1) // old_b
        parts = []
        for j in range(first_rank, last_rank + 1):
            part: ShardBatches[T] = ShardBatches(
                self.reader.for_rank(j, old_dp),
                self.encode,
                kind=cur.kind,
                batch_size=old_b,
                drop_last=True,
                fingerprint=cur.fingerprint,
            )
            part.reader.set_seed(ranks[j].seed)
            part.load_state_dict(ranks[j].to_dict())
            parts.append(part)
        offset = first_rank * old_b
        cur.seed, cur.epoch, cur.step, cur.cursor = first.seed, first.epoch, first.step, 0
        self.reader.set_seed(first.seed)
        self._remainder = (old_dp, parts, lo - offset, hi - offset)
        self._generation += 1

    def _iter_remainder(self) -> Iterator[list[T]]:
        assert self._remainder is not None
        _, parts, lo, hi = self._remainder
        iters = [iter(p) for p in parts]
        while True:
            batches = [next(it, None) for it in iters]
            if any(b is None for b in batches):
                break
            merged = [item for b in batches if b is not None for item in b]
            self.state.step += 1
            ended = parts[0].state.step == 0
            if ended:
                self.state.epoch, self.state.step = parts[0].state.epoch, 0
                self._remainder = None
            yield merged[lo:hi]
            if ended:
                return

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
        if self._remainder is not None:
            return self._iter_remainder()
        return self._iter_own()

    def _iter_own(self) -> Iterator[list[T]]:
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
