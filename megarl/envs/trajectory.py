"""A multi-turn trajectory as token ids: the prompt, then model turns and environment deltas.

Everything after the prompt is the trajectory's *response*: model tokens (``mask`` 1, exactly as
sampled, with the rollout engine's logprobs) and environment tokens (``mask`` 0, logprob 0). The
trainer scores these same ids; its losses, KL, entropy, advantages and the rollout-trainer
mismatch cover the masked-in tokens alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.envs.base import EnvError, Message

# Why a trajectory ended: the environment said done | its token budget ran out | it used
# rollout.environment.max_turns model turns | its environment failed (reward 0, counted).
FINISH_REASONS = ("stop", "length", "turns", "error")
TRUNCATED = ("length", "turns")


@dataclass
class Trajectory:
    sample: int  # the sample's index in the whole step (all data-parallel ranks)
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: a model token
    logprobs: list[float] = field(default_factory=list)  # rollout logprobs (0 at env tokens)
    messages: list[Message] = field(default_factory=list)  # the conversation (executing rank)
    turn_rewards: list[float | None] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)  # response index of each turn's last token
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's, summed
    # None while it runs; then one of FINISH_REASONS (a one-reply trajectory, no environment:
    # its engine's own reason, megarl.rollout.one_reply)
    finish: str | None = None
    error: str | None = None
    # ended before rollout.environment.max_turns because the response budget (rollout.sampling.max_response_length)
    # had no room for the environment's message or another turn
    budget_cut: bool = False
    # actor.router_replay: the experts the rollout engine routed each id of prompt + response
    # to, [ids, MoE layers, top_k] int16 on the host, -1 where no call routed it (None: not
    # recorded); see :meth:`add_model_turn`
    routes: torch.Tensor | None = None
    # the policy version (optimizer steps) that sampled each response token, where the rollout
    # records it (an asynchronous one-reply rollout, whose partial rounds may span versions);
    # None: every token is of the version the batch was generated at
    versions: list[int] | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def turns(self) -> int:
        return len(self.turn_ends)

    @property
    def env_tokens(self) -> int:
        return len(self.mask) - sum(self.mask)

    @property
    def truncated(self) -> bool:
        return self.finish in TRUNCATED

    @property
    def final_text(self) -> str:
        """The last model turn's text (what rule scorers read; empty on a non-executing rank)."""
        for m in reversed(self.messages):
            if m.get("role") == "assistant":
                return str(m.get("content", ""))
        return ""

    @property
    def final_turn_ids(self) -> list[int]:
        """The last model turn's token ids, its stop token included (empty when the model never
        spoke): what the rule scorers read, decoded as a single-turn response is."""
        end = len(self.mask)
        while end and not self.mask[end - 1]:
            end -= 1
        start = end
        while start and self.mask[start - 1]:
            start -= 1
        return self.response_ids[start:end]

    @property
    def env_reward(self) -> float:
        """The sum of the environment's turn rewards (None counts as 0)."""
        return float(sum(r for r in self.turn_rewards if r is not None))

    @property
    def env_scored_outcome(self) -> bool:
        """Whether the environment rewarded the final turn itself; if not, the run's reward
        (rule scorer or reward model) scores the final conversation, added to the turn rewards."""
        return bool(self.turn_rewards) and self.turn_rewards[-1] is not None

    def add_model_turn(
        self, ids: list[int], logprobs: list[float], routes: torch.Tensor | None = None
    ) -> None:
        """Append a model turn sampled after every id so far; ``routes``: the engine call's
        record of that context and of ``ids`` (:attr:`routes`' layout, one row per id)."""
        if routes is not None:
            self.routes = merged_routes(
                self.routes, routes, len(self.prompt_ids) + len(self.response_ids) + len(ids)
            )
        self.response_ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs[: len(ids)]]
        self.logprobs += [0.0] * (len(ids) - len(logprobs))
        self.turn_ends.append(max(len(self.response_ids) - 1, 0))

    def add_env_tokens(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_metrics(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.metrics[k] = self.metrics.get(k, 0.0) + float(v)

    def end(self, reason: str, error: str | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        self.finish = reason
        self.error = error


def merged_routes(kept: torch.Tensor | None, call: torch.Tensor, length: int) -> torch.Tensor:
    """A trajectory's routes after one more engine call: ``call`` (``length`` rows: the call's
    context, then its new ids) where ``kept`` (the earlier calls' rows) has none, ``kept`` where
    it has. An id keeps the experts of the first call that routed it: the call whose logprobs its
    own output gave. A later call's prefill fills what earlier calls never read: each turn's last
    id and the environment's ids between turns, which the next turn's logprobs were computed
    over."""
    if call.shape[0] != length:
        raise ValueError(
            f"routing replay: the engine recorded {call.shape[0]} ids' experts for a turn that "
            f"leaves the trajectory {length} ids long"
        )
    if kept is None:
        return call
    out = call.clone()
    head = out[: kept.shape[0]]
    head.copy_(torch.where(kept >= 0, kept, head))
    return out


def step_routes(ours: list[Trajectory], step: list[Trajectory]) -> list[torch.Tensor]:
    """Each of ``ours``' routes, for a trainer rank (empty: none recorded in the whole ``step``);
    a trajectory no engine call routed (its environment failed at reset, an agent that sent no
    request) gets -1 on every id, shaped as the step's others."""
    shaped = next((t.routes for t in step if t.routes is not None), None)
    if shaped is None:
        return []
    return [
        t.routes
        if t.routes is not None
        else torch.full(
            (len(t.prompt_ids) + len(t.response_ids), *shaped.shape[1:]),
            -1,
            dtype=shaped.dtype,
            device="cpu",  # host memory, like every record
        )
        for t in ours
    ]


# The per-trajectory counters environments report that have metric names of their own; any
# other counter K is logged as rollout/env/K_mean.
_NAMED = {"tool_calls": "rollout/tool_calls_mean"}
_TOTALS = {
    "tool_errors": "rollout/tool_errors",
    "tool_truncated": "rollout/tool_truncated",
    "tool_malformed": "rollout/tool_malformed",  # calls that could not be read (in tool_errors)
}


def trajectory_metrics(trajectories: list[Trajectory], env_seconds: float) -> dict[str, float]:
    """The step's multi-turn metrics over all its trajectories (every rank computes the same):
    turns, tool calls and errors, environment tokens, truncation and failures, and the wall
    seconds spent in environments (the slowest engine's)."""
    n = max(len(trajectories), 1)
    out = {
        "rollout/turns_mean": sum(t.turns for t in trajectories) / n,
        "rollout/turns_max": float(max((t.turns for t in trajectories), default=0)),
        "rollout/env_tokens_mean": sum(t.env_tokens for t in trajectories) / n,
        "rollout/truncated": sum(t.truncated for t in trajectories) / n,
        "rollout/budget_cut": sum(t.budget_cut for t in trajectories) / n,
        "rollout/env_failures": float(sum(t.finish == "error" for t in trajectories)),
        "rollout/tool_s": float(env_seconds),
        "rollout/tool_calls_mean": 0.0,
        "rollout/tool_errors": 0.0,
    }
    keys = sorted({k for t in trajectories for k in t.metrics})
    for key in keys:
        values = [t.metrics.get(key, 0.0) for t in trajectories]
        if key in _TOTALS:
            out[_TOTALS[key]] = float(sum(values))
        elif key != "tool_s":  # per-call seconds: rollout/tool_s is the wall time
            out[_NAMED.get(key, f"rollout/env/{key}_mean")] = sum(values) / n
    return out


def check_env_failures(trajectories: list[Trajectory], max_failed_share: float) -> None:
    """Raise EnvError, showing the first failure, when more than ``max_failed_share`` of a step's
    trajectories failed in their environment (rollout.environment.max_env_failures)."""
    failed = [t for t in trajectories if t.finish == "error"]
    if failed and len(failed) > max_failed_share * len(trajectories):
        raise EnvError(
            f"{len(failed)} of the step's {len(trajectories)} samples failed in their environment, "
            f"more than rollout.environment.max_env_failures={max_failed_share:g} of them; the first "
            f"(sample {failed[0].sample}):\n{failed[0].error}"
        )
