"""The multi-turn rollout's pieces, and its lock-step loop (``rollout.environment.turn_loop=lockstep``,
:func:`run_trajectories`): trajectories generated turn by turn over the rollout engine seam. The
continuous loop (:mod:`megarl.rollout.continuous`) uses the same pieces (the start, the first
turn, the budgets and seeds, what an environment's answer does to a trajectory) and differs only
in when each trajectory's next turn is sent.

In the lock-step loop, every turn, all active trajectories of an engine go to the engine in one
``generate`` call (turn-level batching), each with its own seed (run seed, rollout index, sample, turn: the same
tokens whatever the layout) and its own token budget (``min(per-turn limit, what the trajectory
has left)``). The environments then answer the turn, concurrently; their messages come back as
token deltas of the chat template, appended to the trajectories for the next turn.

The first turn is the single-turn rollout's own request when it can be: when every prompt's
samples start from the same ids, each prompt goes to the engine once with ``n`` samples and the
single-turn seed (:func:`~megarl.rollout.rollout_split.prompt_seed`), so an environment
that ends after one turn and adds nothing reproduces the run without an environment token for
token.

Environments run on one rank of the engine (its *executing* rank, holding an
:class:`~megarl.envs.runner.EnvRunner`); ``share`` hands that rank's results to the others, so a
tool with side effects runs once per sample, never once per tensor-parallel rank, and every rank
of the engine sends the engine the same requests. The loop knows nothing else of the training
layout: an asynchronous rollout worker can drive it over its own engine with ``share`` the
identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar, cast

import torch

from megarl.envs.runner import EnvRunner, Started, Stepped
from megarl.envs.trajectory import Trajectory
from megarl.rollout.rollout_split import SampleStart, prompt_seed
from megarl.rollout.rollout_types import Generates, SamplingConfig
from megarl.rollout.seeds import sequence_seed
from megarl.rollout.trajectory_source import Share

T = TypeVar("T")


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int  # model turns per trajectory
    max_response_tokens: int  # everything after the prompt: model turns and environment tokens
    max_turn_tokens: int  # new tokens of one model turn


Turn = tuple[list[int], list[float], str, torch.Tensor | None]
"""One model turn as the engine gave it: token ids, logprobs, finish reason, and the engine's
routes of the context and the new ids (None: not recorded)."""

Answer = tuple[list[int], float | None, bool, dict[str, float], str | None]
"""An environment's answer to a model turn as every rank of the engine gets it: its tokens,
reward, done, metrics and error (None: it answered)."""


def turn_seed(sampling: SamplingConfig, rollout_index: int, sample: int, turn: int) -> int:
    """The request seed of one model turn: distinct for every (rollout, sample, turn); turn 0
    is the first-turn request's sample (:func:`~megarl.rollout.rollout_split.prompt_seed`
    + ``j``)."""
    return sequence_seed(sampling.seed, rollout_index, sample, segment=turn)


def _first_turn_groups(ts: Sequence[Trajectory], n: int) -> list[list[int]] | None:
    """Positions in ``ts`` of each prompt's ``n`` samples, in sample order, when every prompt has
    all ``n`` on their first turn with the same prompt ids; None otherwise."""
    if n <= 1 or len(ts) % n or any(t.turns or t.response_ids for t in ts):
        return None
    groups: list[list[int]] = []
    for lo in range(0, len(ts), n):
        members = list(range(lo, lo + n))
        first = ts[lo]
        if [ts[k].sample for k in members] != list(range(first.sample, first.sample + n)):
            return None
        if first.sample % n or any(ts[k].prompt_ids != first.prompt_ids for k in members):
            return None
        groups.append(members)
    return groups


def _generate_turn(
    engine: Generates,
    ts: Sequence[Trajectory],
    sampling: SamplingConfig,
    limits: TurnLimits,
    rollout_index: int,
) -> list[Turn]:
    """One turn of ``ts`` in one ``generate`` call: (token ids, logprobs, finish reason, the
    engine's routes of the context and the new ids or None) each."""
    budgets = [turn_budget(t, limits) for t in ts]
    n = max(1, sampling.n)
    groups = _first_turn_groups(ts, n)
    if groups is not None:
        out = engine.generate(
            [ts[g[0]].prompt_ids for g in groups],
            sampling,
            seeds=[prompt_seed(sampling, rollout_index, ts[g[0]].sample // n) for g in groups],
            max_new_tokens=[budgets[g[0]] for g in groups],
        )
        order = [k for g in groups for k in g]
        if list(out.prompt_index) != [q for q, g in enumerate(groups) for _ in g]:
            raise RuntimeError(
                f"the rollout engine returned {len(out.token_ids)} responses for "
                f"{len(groups)} prompts x {n} samples"
            )
    else:
        out = engine.generate(
            [t.prompt_ids + t.response_ids for t in ts],
            replace(sampling, n=1),
            seeds=[turn_seed(sampling, rollout_index, t.sample, t.turns) for t in ts],
            max_new_tokens=budgets,
        )
        if len(out.token_ids) != len(ts):
            raise RuntimeError(
                f"the rollout engine returned {len(out.token_ids)} responses for {len(ts)} turns"
            )
        order = list(range(len(ts)))
    result: list = [None] * len(ts)
    for q, k in enumerate(order):
        routes = out.routes[q] if out.routes else None
        result[k] = (list(out.token_ids[q]), list(out.logprobs[q]), out.finish_reasons[q], routes)
    return result


def _identity(value: T | None, /) -> T:
    return cast(T, value)  # one rank: it is the executing one


def answer_of(stepped: Stepped) -> Answer:
    if stepped.step is None:
        return [], None, True, {}, stepped.error
    step = stepped.step
    return list(stepped.env_ids), step.reward, step.done, step.metrics, None


def open_next(t: Trajectory, limits: TurnLimits) -> bool:
    """Whether another model turn may follow the one ``t`` just took (the environment is told
    when this one is its last)."""
    return t.turns < limits.max_turns and limits.max_response_tokens - len(t.response_ids) > 1


def turn_budget(t: Trajectory, limits: TurnLimits) -> int:
    """The new tokens ``t``'s next model turn may take."""
    return min(limits.max_turn_tokens, limits.max_response_tokens - len(t.response_ids))


def take_answer(t: Trajectory, finish: str, answer: Answer, limits: TurnLimits) -> None:
    """``t`` after its environment answered its last model turn (which ended with ``finish``):
    ended (done, failed, out of turns or room) or holding the environment's tokens."""
    env_ids, reward, done, metrics, error = answer
    t.turn_rewards.append(reward)
    t.add_metrics(metrics)
    # no room for another turn (the environment was told this one is the last)
    out_of_room = limits.max_response_tokens - len(t.response_ids) <= 1
    if error is not None:
        t.end("error", error)
    elif done:  # a last turn cut at its token budget leaves the trajectory truncated
        t.end("length" if finish == "length" else "stop")
        t.budget_cut = out_of_room and t.turns < limits.max_turns
    elif t.turns >= limits.max_turns:
        t.end("turns")
    elif len(t.response_ids) + len(env_ids) >= limits.max_response_tokens:
        t.end("length")  # the environment's message does not fit
        t.budget_cut = True
    else:
        t.add_env_tokens(list(env_ids))


def start_trajectories(
    starts: Sequence[SampleStart],
    runner: EnvRunner | None,
    rollout_index: int,
    pad_id: int,
    share: Share,
) -> tuple[list[Started], list[Trajectory]]:
    """The environments reset on the executing rank (``runner``; its ``Started`` per start, an
    empty list elsewhere) and one trajectory per start on every rank; a sample whose reset
    failed is ended with one masked token that trains nothing."""
    started: list[Started] = []
    if runner is not None:
        started = runner.reset_all([(s.sample, s.row) for s in starts], rollout_index)
    heads = share([(st.prompt_ids, st.error) for st in started] if runner is not None else None)
    trajectories = []
    for k, (start, (prompt, error)) in enumerate(zip(starts, heads, strict=True)):
        t = Trajectory(sample=start.sample, prompt_ids=list(prompt or start.fallback_prompt))
        if runner is not None:
            t.messages = started[k].messages
        if error is not None:
            t.add_env_tokens([pad_id])
            t.end("error", error)
        trajectories.append(t)
    return started, trajectories


def model_turn(
    engine: Generates,
    ts: Sequence[Trajectory],
    sampling: SamplingConfig,
    limits: TurnLimits,
    rollout_index: int,
    share: Share,
    executing: bool,
) -> list[Turn]:
    """One model turn of ``ts`` in one engine call on every rank of the engine, appended to each
    trajectory; the executing rank's tokens are the trajectory's on every rank."""
    turn = _generate_turn(engine, ts, sampling, limits, rollout_index)
    model = share(turn if executing else None)
    for t, (ids, logprobs, _, routes) in zip(ts, model, strict=True):
        t.add_model_turn(list(ids), list(logprobs), routes)
    return model


def run_trajectories(
    engine: Generates,
    starts: Sequence[SampleStart],
    runner: EnvRunner | None,
    sampling: SamplingConfig,
    limits: TurnLimits,
    *,
    rollout_index: int,
    pad_id: int,
    share: Share = _identity,
) -> list[Trajectory]:
    """The trajectories of ``starts`` (one environment instance each), lock-step: every turn of
    every active trajectory is one engine call, the next after the turn's slowest environment.
    ``runner`` is the executing rank's (None elsewhere); ``rollout_index`` (the run's rollout
    count) and each sample's index in the step seed every turn (:func:`turn_seed`)."""
    started, trajectories = start_trajectories(starts, runner, rollout_index, pad_id, share)
    while active := [k for k, t in enumerate(trajectories) if not t.done]:
        ts = [trajectories[k] for k in active]
        # every rank of the engine takes part in the call
        model = model_turn(engine, ts, sampling, limits, rollout_index, share, runner is not None)
        answers = None
        if runner is not None:
            items = [
                (started[k], ids, open_next(t, limits))
                for k, t, (ids, *_) in zip(active, ts, model, strict=True)
            ]
            answers = [answer_of(a) for a in runner.step_all(items)]
        shared = share(answers)
        for t, (_, _, finish, _), answer in zip(ts, model, shared, strict=True):
            take_answer(t, finish, answer, limits)
    return trajectories
