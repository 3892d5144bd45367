"""A multi-turn trajectory as token ids: the prompt, then model turns and environment deltas.

Everything after the prompt is the trajectory's *response*: model tokens (``mask`` 1, exactly as
sampled, with the rollout engine's logprobs) and environment tokens (``mask`` 0, logprob 0). The
trainer scores these same ids; its losses, KL, entropy, advantages and the rollout-trainer
mismatch cover the masked-in tokens alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.envs.base import EnvError, Message

# Why a trajectory ended: the environment said done | its token budget ran out | it used
# rollout.max_turns model turns | its environment failed (reward 0, counted).
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
    finish: str | None = None  # None while it runs; then one of FINISH_REASONS
    error: str | None = None
    # ended before rollout.max_turns because the response budget (rollout.max_response_length)
    # had no room for the environment's message or another turn
    budget_cut: bool = False

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

    def add_model_turn(self, ids: list[int], logprobs: list[float]) -> None:
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
    trajectories failed in their environment (rollout.max_env_failures)."""
    failed = [t for t in trajectories if t.finish == "error"]
    if failed and len(failed) > max_failed_share * len(trajectories):
        raise EnvError(
            f"{len(failed)} of the step's {len(trajectories)} samples failed in their environment, "
            f"more than rollout.max_env_failures={max_failed_share:g} of them; the first "
            f"(sample {failed[0].sample}):\n{failed[0].error}"
        )
