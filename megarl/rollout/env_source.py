"""``rollout.env``'s trajectories for either placement's engines
(:class:`~megarl.rollout.trajectory_source.TrajectorySource`), run by the turn loop
``rollout.environment.turn_loop`` names (:data:`TURN_LOOPS`): ``continuous`` (each trajectory goes on as its
own environment answers, :mod:`megarl.rollout.continuous`) or ``lockstep`` (every turn of every
trajectory in one call, :func:`megarl.rollout.multi_turn.run_trajectories`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from megarl.envs.runner import EnvRunner
from megarl.envs.trajectory import Trajectory, trajectory_metrics
from megarl.rollout.continuous import run_continuous
from megarl.rollout.multi_turn import TurnLimits, run_trajectories
from megarl.rollout.rollout_split import SampleStart
from megarl.rollout.rollout_types import Generates, SamplingConfig
from megarl.rollout.trajectory_source import EngineJob, EngineTrajectories, Share


class TurnLoop(Protocol):
    def __call__(
        self,
        engine: Generates,
        starts: Sequence[SampleStart],
        runner: EnvRunner | None,
        sampling: SamplingConfig,
        limits: TurnLimits,
        *,
        rollout_index: int,
        pad_id: int,
        share: Share,
    ) -> list[Trajectory] | None:
        """The trajectories of ``starts`` on the executing rank (``runner``'s); every rank of the
        engine calls it."""
        ...


TURN_LOOPS: dict[str, TurnLoop] = {"continuous": run_continuous, "lockstep": run_trajectories}


@dataclass(frozen=True)
class EnvSource:
    """``rollout.env``'s trajectories for the hybrid engine
    (:class:`~megarl.rollout.trajectory_source.TrajectorySource`): the turn loop on every rank
    of an engine, the environments on its first rank (``runner`` is that rank's; None
    elsewhere)."""

    runner: EnvRunner | None
    sampling: SamplingConfig
    limits: TurnLimits
    pad_id: int
    turn_loop: str = "continuous"  # a key of TURN_LOOPS (rollout.environment.turn_loop)

    @property
    def conversations(self) -> bool:
        return True

    def run(self, job: EngineJob) -> EngineTrajectories | None:
        runner = self.runner if job.leader else None
        trajectories = TURN_LOOPS[self.turn_loop](
            job.engine,
            job.starts,
            runner,
            self.sampling,
            self.limits,
            rollout_index=job.rollout_index,
            pad_id=self.pad_id,
            share=job.share,
        )
        if not job.leader:
            return None
        assert trajectories is not None, "the executing rank has the trajectories"
        seconds = runner.take_seconds() if runner is not None else 0.0
        return EngineTrajectories(trajectories, seconds)

    def step_metrics(self, parts: Sequence[EngineTrajectories]) -> dict[str, float]:
        step = [t for part in parts for t in part.trajectories]
        return trajectory_metrics(step, max((p.seconds for p in parts), default=0.0))
