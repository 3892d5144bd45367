"""Where a colocated rollout's trajectories come from, behind one seam: today's environments
(:class:`~megarl.rollout.env_source.EnvSource`, ``rollout.env``) or an agent behind the
OpenAI-compatible endpoint (:class:`~megarl.agents.trajectories.AgentSource`, ``rollout.agent``).

Both placements drive it the same way: the colocated hybrid engine and the asynchronous rollout
group split a step's samples over their rollout engines and hand each engine's
:class:`~megarl.rollout.rollout_split.SampleStart` list to the source on every rank of that
engine; the source returns the engine's trajectories on the engine's first rank (None on the
others), which are gathered and checked with the failed-sample guard (:func:`step_of`) and turned
into the trainer's samples: one path from trajectories to samples, whatever made them and
wherever they were made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from megarl.envs.trajectory import Trajectory, check_env_failures
from megarl.rollout.rollout_split import SampleStart, one_per_key
from megarl.rollout.rollout_types import Generates

T = TypeVar("T")


class Share(Protocol):
    """The executing rank's value (None on the other ranks) -> that value on every rank."""

    def __call__(self, value: T | None, /) -> T: ...


@dataclass
class EngineTrajectories:
    """One rollout engine's part of a step: its samples' trajectories in sample order, the wall
    seconds spent outside the engine (tools, agents), and counters summed over engines."""

    trajectories: list[Trajectory]
    seconds: float = 0.0
    totals: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineJob:
    """One rollout engine's samples of a step, as every rank of the engine sees them."""

    engine: Generates
    starts: Sequence[SampleStart]
    rollout_index: int  # the run's rollout count: every request's seed depends on it
    leader: bool  # this rank is the engine's first
    share: Share  # the first rank's value on every rank of the engine
    version: int = 0  # the policy version loaded in the engine (asynchronous rollout)
    # asynchronous rollout with rollout.placement.partial: called by every rank of the rollout group
    # between rounds of a reply (whether this engine still generates), returns the version then
    # loaded; None: the whole batch at ``version``
    between: Callable[[bool], int] | None = None


class TrajectorySource(Protocol):
    # whether its trajectories are conversations (an environment's or an agent's turns), which
    # the trainer rewards and logs as such; False: one reply per sample, handed on as responses
    @property
    def conversations(self) -> bool: ...

    def run(self, job: EngineJob) -> EngineTrajectories | None:
        """The trajectories of ``job.starts`` on the engine's first rank, None on its other
        ranks; every rank of the engine calls it."""
        ...

    def step_metrics(self, parts: Sequence[EngineTrajectories]) -> dict[str, float]:
        """The step's rollout metrics from every engine's part (the same on every rank)."""
        ...


def engine_parts(
    gathered: Sequence[tuple[int, EngineTrajectories] | None],
) -> list[EngineTrajectories]:
    """One part per engine, in engine order, from what every rank sent (None from the ranks that
    are not an engine's first)."""
    return [part for _, part in one_per_key(gathered)]


def step_of(
    gathered: Sequence[tuple[int, EngineTrajectories] | None], max_failed_share: float
) -> tuple[list[EngineTrajectories], list[Trajectory]]:
    """Every engine's part (from what every rank sent) and the step's trajectories in engine
    order; raises EnvError (the first failure shown) when more than ``max_failed_share`` of them
    failed."""
    parts = engine_parts(gathered)
    step = [t for part in parts for t in part.trajectories]
    check_env_failures(step, max_failed_share)
    return parts, step


def summed_totals(parts: Sequence[EngineTrajectories]) -> dict[str, float]:
    """The engines' counters, summed."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.totals.items():
            out[key] = out.get(key, 0.0) + value
    return out


__all__ = [
    "EngineJob",
    "EngineTrajectories",
    "Share",
    "TrajectorySource",
    "engine_parts",
    "step_of",
    "summed_totals",
]
