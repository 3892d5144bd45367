"""How the colocated engine makes a batch's samples, one of three ways picked once by the
assembly: one reply per sample (:class:`OneReply`), an environment's turns (``rollout.env``,
:class:`EnvironmentTurns`), or an agent's runs through the engine's endpoint (``rollout.agent``,
:class:`AgentRuns`). The source (:mod:`megarl.trainer.colocated_source`) calls the one it holds
for training and validation batches alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from megarl.data import PromptItem
from megarl.envs.runner import EnvRunner
from megarl.hybrid_engine.engine import HybridEngine, RolloutBatch
from megarl.hybrid_engine.multi_turn import TurnLimits
from megarl.hybrid_engine.rollout_types import SamplingConfig
from megarl.trainer.agent_rollout import agent_batch

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
    def make(
        self, engine: HybridEngine, items: list[PromptItem], sampling: SamplingConfig
    ) -> RolloutBatch:
        """This DP rank's samples of ``items`` from the awake engine (collective)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class OneReply:
    """One response per sample (no environment, no agent)."""

    def make(
        self, engine: HybridEngine, items: list[PromptItem], sampling: SamplingConfig
    ) -> RolloutBatch:
        return engine.generate([it.input_ids for it in items], sampling)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class EnvironmentTurns:
    """``rollout.env``: one multi-turn trajectory per sample (megarl.hybrid_engine.multi_turn);
    ``runner`` exists on the ranks that run environments (None on the others)."""

    limits: TurnLimits
    runner: EnvRunner | None
    pad_id: int
    max_failed_share: float

    def make(
        self, engine: HybridEngine, items: list[PromptItem], sampling: SamplingConfig
    ) -> RolloutBatch:
        return engine.generate_trajectories(
            [dataset_row(it) for it in items],
            [it.input_ids for it in items],
            sampling,
            self.limits,
            self.runner,
            self.pad_id,
            max_failed_share=self.max_failed_share,
        )

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


@dataclass(frozen=True)
class AgentRuns:
    """``rollout.agent``: one trajectory per agent run (megarl.trainer.agent_rollout)."""

    agent: AgentSource
    max_failed_share: float

    def make(
        self, engine: HybridEngine, items: list[PromptItem], sampling: SamplingConfig
    ) -> RolloutBatch:
        return agent_batch(
            engine,
            self.agent,
            [dataset_row(it) for it in items],
            [it.input_ids for it in items],
            sampling,
            self.max_failed_share,
        )

    def close(self) -> None:
        pass
