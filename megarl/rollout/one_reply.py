"""Single-turn rollout as the one-turn case of the trajectory source: one reply per sample, no
environment, no agent (:class:`OneReplySource`).

Both placements run every rollout through one path: the colocated hybrid engine's
:meth:`~megarl.rollout.engine.HybridEngine.generate_from` and the asynchronous rollout group
split a step's samples over their engines and hand each engine's samples to a
:class:`~megarl.rollout.trajectory_source.TrajectorySource`. This one makes one reply per sample:
every rank of the engine makes the same :func:`~megarl.rollout.versioned.generate_versioned` call
(all ``n`` samples of a prompt in one request, seeded as every rollout is:
:mod:`megarl.rollout.seeds`), and the engine's first rank turns the replies into one-turn
trajectories that keep the engine's finish reason, logprobs, routed experts and, with partial
rounds (``rollout.placement.partial``), the policy version of every token.

Its trajectories are plain replies (``conversations`` is False): the trainer gets them as
responses, scored and logged as a single-turn run always was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megarl.envs.trajectory import Trajectory
from megarl.rollout.rollout_batch import reply_trajectory
from megarl.rollout.rollout_split import SampleStart
from megarl.rollout.rollout_types import SamplingConfig
from megarl.rollout.trajectory_source import EngineJob, EngineTrajectories
from megarl.rollout.versioned import VersionedOutput, generate_versioned


def prompts_of(starts: Sequence[SampleStart], n: int) -> tuple[list[list[int]], int]:
    """The prompts of ``starts`` (``n`` consecutive samples of each, numbered by global index)
    and the global index of the first."""
    if len(starts) % n:
        raise ValueError(f"{len(starts)} samples are not {n} per prompt")
    heads = starts[::n]
    first = heads[0].sample // n if heads else 0
    for g, start in enumerate(heads):
        if start.sample != (first + g) * n:
            raise ValueError(f"sample {start.sample} is not the first of prompt {first + g}")
    return [list(start.fallback_prompt) for start in heads], first


def one_turn_trajectories(
    starts: Sequence[SampleStart], prompts: Sequence[list[int]], out: VersionedOutput, n: int
) -> list[Trajectory]:
    """Each sample's reply as a one-turn trajectory (prompt-major ``out``: sample j of prompt i
    at ``i * n + j``, as ``starts``)."""
    replies = out.output
    if replies.prompt_index != [i for i in range(len(prompts)) for _ in range(n)]:
        raise RuntimeError("the engine returned replies out of prompt-major order")
    trajectories = []
    for k, start in enumerate(starts):
        t = reply_trajectory(start.sample, prompts[k // n], replies, k)
        t.versions = list(out.versions[k])
        trajectories.append(t)
    return trajectories


@dataclass(frozen=True)
class OneReplySource:
    """One reply per sample of ``sampling``; ``partial_chunk``: with a job that may load newer
    weights between rounds (``EngineJob.between``), rounds of at most that many tokens
    (``rollout.placement.partial_chunk_tokens``)."""

    sampling: SamplingConfig
    partial_chunk: int | None = None

    @property
    def conversations(self) -> bool:
        return False

    def run(self, job: EngineJob) -> EngineTrajectories | None:
        n = max(1, self.sampling.n)
        prompts, first = prompts_of(job.starts, n)
        chunk = self.partial_chunk if job.between is not None else None
        out = generate_versioned(
            job.engine,
            prompts,
            self.sampling,
            job.rollout_index,
            first,
            job.version,
            chunk,
            job.between,
        )
        if not job.leader:
            return None
        return EngineTrajectories(one_turn_trajectories(job.starts, prompts, out, n))

    def step_metrics(self, parts: Sequence[EngineTrajectories]) -> dict[str, float]:
        """None: a single-turn step has no turns, tools or environment to report."""
        return {}


__all__ = ["OneReplySource", "one_turn_trajectories", "prompts_of"]
