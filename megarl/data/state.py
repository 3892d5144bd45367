"""A dataset's position, as plain JSON, so a resumed run sees exactly the rows it would have seen."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megarl.data.errors import DataError

STATE_FORMAT = "megarl.data.state/1"


@dataclass
class DataState:
    """Where one data-parallel rank stands in its shard.

    `step` counts batches delivered in `epoch`; `cursor` counts rows of this rank's share consumed
    in `epoch`, dropped rows included (it passes the share size when a rank refills batches from
    the start of its share). `cursor` is per rank: save one state per data-parallel rank.
    """

    kind: str
    seed: int
    epoch: int
    step: int
    cursor: int
    dp_rank: int
    dp_size: int
    batch_size_per_rank: int
    fingerprint: str
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def at_epoch_start(self) -> bool:
        return self.step == 0 and self.cursor == 0

    def to_dict(self) -> dict[str, object]:
        return {"format": STATE_FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: object) -> DataState:
        if not isinstance(d, dict) or d.get("format") != STATE_FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise DataError(
                f"data state: expected a dict with format '{STATE_FORMAT}' (from a dataset's "
                f"state_dict()), got {got!r}."
            )
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise DataError(f"data state: missing keys {missing}; it is damaged, save it again.")
        ints = ("seed", "epoch", "step", "cursor", "dp_rank", "dp_size", "batch_size_per_rank")
        bad = [
            n
            for n in ints
            if not isinstance(d[n], int) or isinstance(d[n], bool) or (d[n] < 0 and n != "seed")
        ]
        if bad:
            raise DataError(f"data state: keys {bad} must be non-negative integers.")
        return cls(**{n: d[n] for n in names})

    def check_resumable(self, current: DataState) -> None:
        """Refuse a saved state that would not replay the same rows in `current`'s setting."""
        if self.kind != current.kind:
            raise DataError(
                f"data state is for a {self.kind} dataset, not a {current.kind} dataset."
            )
        if self.fingerprint != current.fingerprint:
            raise DataError(
                "data state was saved over other data (file names or row groups differ); "
                "resume with the same files, or start the data from scratch by not loading it."
            )
        if self.at_epoch_start:
            return  # an epoch boundary resumes under any layout
        layout = ("dp_rank", "dp_size", "batch_size_per_rank")
        diff = {
            k: (getattr(self, k), getattr(current, k))
            for k in layout
            if getattr(self, k) != getattr(current, k)
        }
        if diff:
            details = ", ".join(f"{k} saved {a}, now {b}" for k, (a, b) in diff.items())
            raise DataError(
                f"data state was saved mid-epoch under another layout ({details}); resume with "
                "the same data-parallel size, rank and batch size, or from an epoch boundary."
            )
