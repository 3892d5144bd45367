"""How a batch's samples are made, one of three ways picked once by the assembly: one reply per
sample (:class:`OneReply`), an environment's turns (``rollout.env``, :class:`EnvironmentTurns`),
or an agent's runs through the engine's endpoint (``rollout.agent``, :class:`AgentRuns`).

Each is the :class:`~megarl.rollout.trajectory_source.TrajectorySource` for a sampling setting
(:meth:`TrajectoryMaker.source`), so every rollout, single-turn included, runs through one path in
both placements: the colocated source (:mod:`megarl.trainer.colocated_source`) calls
:meth:`TrajectoryMaker.make` for training and validation batches alike (the hybrid engine's
``generate_from``), and the asynchronous rollout group (:mod:`megarl.trainer.rollout_group`)
drives the same source over its own engines."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from megarl.data import PromptItem
from megarl.envs.runner import EnvRunner
from megarl.rollout.engine import HybridEngine
from megarl.rollout.env_source import EnvSource
from megarl.rollout.multi_turn import TurnLimits
from megarl.rollout.one_reply import OneReplySource
from megarl.rollout.rollout_batch import RolloutBatch
from megarl.rollout.rollout_types import SamplingConfig
from megarl.rollout.trajectory_source import TrajectorySource

if TYPE_CHECKING:
    from megarl.agents.trajectories import AgentSource


def dataset_row(item: PromptItem) -> dict[str, object]:
    """The parquet row an environment's reset reads: the schema's columns and every other one."""
    return {
        "prompt": item.prompt,
        "data_source": item.data_source,
        "reward_model": item.reward_model,
        "extra_info": item.extra_info,
        **item.extra,
    }


class TrajectoryMaker(Protocol):
    def source(self, sampling: SamplingConfig) -> TrajectorySource:
        """The trajectories' source when the engine samples with ``sampling``."""
        ...

    def make(
        self, engine: HybridEngine, items: list[PromptItem], sampling: SamplingConfig
    ) -> RolloutBatch:
        """This DP rank's samples of ``items`` from the awake engine (collective)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class OneReply:
    """One response per sample (no environment, no agent); ``partial_chunk``: the asynchronous
    rollout's rounds with ``rollout.placement.partial`` (``rollout.placement.partial_chunk_tokens``)."""

    partial_chunk: int | None = None

    def source(self, sampling: SamplingConfig) -> TrajectorySource:
        return OneReplySource(sampling, self.partial_chunk)

    def make(
        self, engine: HybridEngine, items: list[PromptItem], sampling: SamplingConfig
    ) -> RolloutBatch:
        return engine.generate([it.input_ids for it in items], sampling)

    def close(self) -> None:
        pass


def _from_source(
    maker: TrajectoryMaker,
    engine: HybridEngine,
    items: list[PromptItem],
    sampling: SamplingConfig,
    max_failed_share: float,
) -> RolloutBatch:
    """``maker``'s trajectories of this DP rank's ``items``, ``sampling.n`` per item."""
    return engine.generate_from(
        [dataset_row(it) for it in items],
        [it.input_ids for it in items],
        sampling.n,
        maker.source(sampling),
        max_failed_share,
    )


@dataclass(frozen=True)
class EnvironmentTurns:
    """``rollout.env``: one multi-turn trajectory per sample (megarl.rollout.multi_turn);
    ``runner`` exists on the ranks that run environments (None on the others)."""

    limits: TurnLimits
    runner: EnvRunner | None
    pad_id: int
    max_failed_share: float
    turn_loop: str = "continuous"  # rollout.environment.turn_loop

    def source(self, sampling: SamplingConfig) -> TrajectorySource:
        return EnvSource(self.runner, sampling, self.limits, self.pad_id, self.turn_loop)

    def make(
        self, engine: HybridEngine, items: list[PromptItem], sampling: SamplingConfig
    ) -> RolloutBatch:
        return _from_source(self, engine, items, sampling, self.max_failed_share)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


@dataclass(frozen=True)
class AgentRuns:
    """``rollout.agent``: one trajectory per agent run (megarl.agents), the endpoint sampling
    with the batch's setting (training or validation)."""

    agent: AgentSource
    max_failed_share: float

    def source(self, sampling: SamplingConfig) -> TrajectorySource:
        settings = replace(self.agent.settings, seed=sampling.seed)
        return replace(self.agent, sampling=sampling, settings=settings)

    def make(
        self, engine: HybridEngine, items: list[PromptItem], sampling: SamplingConfig
    ) -> RolloutBatch:
        return _from_source(self, engine, items, sampling, self.max_failed_share)

    def close(self) -> None:
        pass
