"""``rollout.agent`` in training: each rollout engine's samples run through the agent against
an endpoint of its own, and come back as the trajectories the trainer trains on
(:class:`AgentSource`, a :class:`~megarl.rollout.trajectory_source.TrajectorySource`).

On an engine's first rank the source starts the endpoint over the rollout engine, runs the agent
once per sample (:func:`~megarl.agents.runner.run_agents`: a bounded pool, a time limit each) and
turns each sample into one trajectory (:func:`sample_trajectory`); the engine's other ranks make
each of the first rank's engine calls with it (an engine spread over its ranks, vLLM at
tensor-parallel 2 say, needs all of them in every call), as the environments' turn loop does.

One trajectory per sample: the sample's **last segment**, the one holding its final reply. An
agent that edited or dropped messages split its session into segments (counted in
``agent/non_continuations``); the earlier segments are sampled under a context the final one does
not contain, so they are not trained (their model tokens are counted in
``agent/untrained_tokens``). Rewards: the agent's, on the last model token; None leaves the row's
scorer to score the final reply; a failed agent (raised, timed out, no request) scores 0 and
counts as a failed sample for ``rollout.environment.max_env_failures``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megarl.agents.endpoint import AgentEndpoint
from megarl.agents.generation import open_generator
from megarl.agents.loading import Agent
from megarl.agents.runner import AgentLimits, AgentSample, agent_metrics, run_agents
from megarl.agents.turns import TurnSettings
from megarl.envs.trajectory import Trajectory, trajectory_metrics
from megarl.rollout.engine_calls import follow_requests
from megarl.rollout.rollout_split import SampleStart
from megarl.rollout.rollout_types import SamplingConfig
from megarl.rollout.trajectory_source import (
    EngineJob,
    EngineTrajectories,
    summed_totals,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

UNTRAINED_TOKENS = "agent/untrained_tokens"


def sample_trajectory(sample: AgentSample, start: SampleStart, pad_id: int) -> Trajectory:
    """The trajectory ``sample`` trains as: its last segment, its reward on its last turn (None:
    left to the row's scorer); a failed sample without a segment is one masked token that trains
    nothing (ended ``error``: reward 0, counted by the failed-sample guard)."""
    if not sample.segments:
        t = Trajectory(sample=start.sample, prompt_ids=list(start.fallback_prompt))
        t.add_env_tokens([pad_id])
        t.end("error", sample.error or "the agent sent no request")
        return t
    t = sample.segments[-1]
    if sample.failed:
        t.end("error", sample.error)
    elif sample.reward is not None:
        t.turn_rewards = [None] * (t.turns - 1) + [sample.reward]
    return t


@dataclass(frozen=True)
class AgentSource:
    """The agent's trajectories for the hybrid engine; ``sampling`` is the run's (the endpoint
    samples one response per request with it)."""

    agent: Agent
    tokenizer: PreTrainedTokenizerBase
    settings: TurnSettings
    limits: AgentLimits
    sampling: SamplingConfig
    pad_id: int

    @property
    def conversations(self) -> bool:
        return True

    def run(self, job: EngineJob) -> EngineTrajectories | None:
        if not job.leader:  # the engine's other ranks make the first rank's requests too
            follow_requests(job.engine, self.sampling, lambda: job.share(None))
            return None
        rows = [(s.sample, s.row) for s in job.starts]
        try:
            with (
                open_generator(job.engine, self.sampling, job.share) as generator,
                AgentEndpoint(
                    generator, self.tokenizer, self.settings, job.rollout_index
                ) as endpoint,
            ):
                batch = run_agents(self.agent, endpoint, rows, self.limits)
        finally:
            job.share(None)  # the end: every session is closed, no request comes any more
        trajectories = [
            sample_trajectory(sample, start, self.pad_id)
            for sample, start in zip(batch.samples, job.starts, strict=True)
        ]
        totals = batch.totals()
        totals[UNTRAINED_TOKENS] = float(
            sum(sum(seg.mask) for s in batch.samples for seg in s.segments[:-1])
        )
        return EngineTrajectories(trajectories, batch.seconds, totals)

    def step_metrics(self, parts: Sequence[EngineTrajectories]) -> dict[str, float]:
        return agent_step_metrics(parts)


def agent_step_metrics(parts: Sequence[EngineTrajectories]) -> dict[str, float]:
    """The step's rollout metrics (as an environment's) and the runner's ``agent/*``, over every
    engine's part; the seconds are the slowest engine's."""
    step = [t for part in parts for t in part.trajectories]
    seconds = max((p.seconds for p in parts), default=0.0)
    return trajectory_metrics(step, seconds) | agent_metrics(summed_totals(parts), seconds)


__all__ = ["UNTRAINED_TOKENS", "AgentSource", "agent_step_metrics", "sample_trajectory"]
