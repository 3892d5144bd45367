"""What a trainer rank receives of a rollout: one typed record, the same for both placements
(colocated and asynchronous) and for every kind of sample (one reply, an environment's turns, an
agent's conversation).

Each sample is a :class:`~megarl.envs.trajectory.Trajectory` (prompt ids, response ids with
their mask and the rollout engine's logprobs, turns and turn rewards, routes, versions); a
single-turn rollout's are one-turn trajectories whose every response token is the model's. The
trainer builds its training tensors (:mod:`megarl.trainer.experience`) from these records and
nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megarl.envs.trajectory import Trajectory, step_routes
from megarl.rollout.rollout_types import RolloutOutput


@dataclass
class RolloutBatch:
    """This data-parallel rank's samples: sample j of its prompt i at ``i * n + j``."""

    trajectories: list[Trajectory]
    prompt_index: list[int]  # each sample's prompt among this rank's prompts
    # True: environment or agent conversations (their turns, environment tokens and rewards
    # count); False: one reply per sample, every response token the model's
    conversations: bool = False
    metrics: dict[str, float] = field(default_factory=dict)  # conversations: the step's rollout/*

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def finish_reasons(self) -> list[str]:
        """Each sample's end: the engine's ``stop``/``length``, or a trajectory's reason."""
        return [t.finish or "stop" for t in self.trajectories]

    @property
    def response_masks(self) -> list[list[int]] | None:
        """1 on the model's response tokens, 0 on the environment's; None for one-reply samples
        (every token the model's)."""
        return [t.mask for t in self.trajectories] if self.conversations else None

    @property
    def routes(self) -> list[torch.Tensor] | None:
        """Each sample's routed experts (:attr:`Trajectory.routes`); None when the rollout
        recorded none."""
        routes = [t.routes for t in self.trajectories if t.routes is not None]
        if not routes:
            return None
        if len(routes) != len(self.trajectories):
            raise RuntimeError("some samples of a batch carry routes and others none")
        return routes

    def sequences(self) -> list[list[int]]:
        """Each sample's prompt and response ids, as the trainer scores them."""
        return [t.prompt_ids + t.response_ids for t in self.trajectories]


def reply_trajectory(
    sample: int, prompt: Sequence[int], output: RolloutOutput, k: int
) -> Trajectory:
    """Reply ``k`` of an engine's ``output`` as a one-turn trajectory of global index ``sample``:
    every token the model's, with the engine's logprobs, routes and own finish reason (``stop``,
    ``length`` or what else it reports)."""
    t = Trajectory(sample, list(prompt))
    routes = output.routes[k] if output.routes else None
    t.add_model_turn(list(output.token_ids[k]), list(output.logprobs[k]), routes)
    t.finish = output.finish_reasons[k]
    return t


def replies_batch(prompts: Sequence[Sequence[int]], output: RolloutOutput) -> RolloutBatch:
    """The record of an engine's plain replies to ``prompts`` (``output.prompt_index`` into
    them): sample ``k`` is its reply ``k``."""
    trajectories = [
        reply_trajectory(k, prompts[i], output, k) for k, i in enumerate(output.prompt_index)
    ]
    return RolloutBatch(trajectories, list(output.prompt_index))


def rank_batch(
    step: Sequence[Trajectory],
    start: int,
    stop: int,
    n: int,
    conversations: bool = True,
    metrics: dict[str, float] | None = None,
) -> RolloutBatch:
    """The record of prompts ``[start, stop)`` of a step's trajectories (``n`` samples each,
    ``sample`` the global index), prompt indices counted from ``start``. Where the step recorded
    routes, a trajectory no engine call routed gets -1 on every id, shaped as the others."""
    ours = [t for t in step if start * n <= t.sample < stop * n]
    for t, routes in zip(ours, step_routes(ours, list(step)), strict=False):
        t.routes = routes
    return RolloutBatch(
        trajectories=ours,
        prompt_index=[t.sample // n - start for t in ours],
        conversations=conversations,
        metrics=dict(metrics or {}),
    )


__all__ = ["RolloutBatch", "rank_batch", "replies_batch", "reply_trajectory"]
