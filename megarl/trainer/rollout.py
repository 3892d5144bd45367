"""A step's rollout, phase by phase: ``next batch -> rewards -> score``.

:func:`step_batch` is what the loop calls. Each draw (:func:`draw`) takes the next batch from the
run's rollout source (:mod:`megarl.trainer.rollout_source`: prompts and their responses; the
colocated source moves training memory off the device and the actor's weights into the engine
around the generation, the asynchronous one receives what the rollout group generated), then
rewards the responses. DAPO's dynamic sampling (``algorithm.filter_groups``) is a filter around
the draws (:func:`megarl.trainer.dynamic_sampling.filter_groups`), which tells the source after
each draw whether another follows. Only then, with the rollout engine asleep, the actor scores
what the step trains on (:func:`score`): the old logprobs and the rollout-vs-trainer mismatch, in
the update's micro-batches, unless the update's own forward gives both
(:mod:`megarl.trainer.old_log_probs`).

Each phase returns its metrics, and :func:`step_batch` returns them merged for the loop.
Timings: ``timing/rollout_s`` (the transitions and generation), ``timing/reward_s``,
``timing/old_log_prob_s`` (the scoring pass, when it runs); summed over a step's draws.
"""

from __future__ import annotations

from megarl.config import AlgorithmConfig
from megarl.metrics import StepMetrics, declare
from megarl.rollout.mismatch import LOGPROB_MISMATCH_REDUCTIONS
from megarl.run.steps import timed
from megarl.trainer.assembly import PolicyRun
from megarl.trainer.batch import StepBatch
from megarl.trainer.dynamic_sampling import filter_groups
from megarl.trainer.experience import score_rollout
from megarl.trainer.old_log_probs import score_old_log_probs


def draw(run: PolicyRun) -> tuple[StepBatch, StepMetrics]:
    """The rollout source's next batch, rewarded; its memory moves (or weight transfer) and
    timings."""
    got = run.rollout.next_batch()
    rollout = got.rollout
    s = run.startup
    with timed("reward") as reward_time:
        samples, scores, reward_metrics, _ = score_rollout(
            run.rewards, s.tokenizer, s.pad_id, got.items, rollout, run.batching
        )
    reward_metrics |= rollout.metrics  # multi-turn: the step's rollout/* (turns, tools ...)
    batch = StepBatch(samples, scores, rollout.finish_reasons, reward_metrics)
    return batch, got.metrics | reward_time.metrics()


def score(run: PolicyRun, batch: StepBatch) -> StepMetrics:
    """The actor's old logprobs of ``batch`` (into its samples) and the rollout mismatch, in the
    update's micro-batches (the rollout engine asleep); the mismatch and the pass's timing.
    Skipped (no metrics) when the update's forward gives them."""
    if run.spec.old_log_prob_from_update:
        return {}
    with timed("old_log_prob") as took:
        mismatch = score_old_log_probs(
            run.roles.actor.model,
            batch.samples,
            run.roles.dims.vocab_size,
            run.spec.temperature,
            run.batching,
            run.roles.dims.is_moe,
        )
    return declare(mismatch, LOGPROB_MISMATCH_REDUCTIONS) | took.metrics()


def step_batch(run: PolicyRun, a: AlgorithmConfig, target: int) -> tuple[StepBatch, StepMetrics]:
    """This rank's batch of the step: drawn (the source's next batch, rewarded; filtered by
    dynamic sampling when ``algorithm.filter_groups``, to ``target`` groups: the step's,
    ``data.train_batch_size`` over every DP rank), then scored by the actor; the phases'
    timings, memory moves, dynamic-sampling counts and the rollout mismatch."""
    if a.filter_groups:
        decided = run.rollout.draws_decided  # async: the rollout group draws again when told to
        batch, metrics = filter_groups(lambda: draw(run), a, target, run.startup.pad_id, decided)
    else:
        batch, metrics = draw(run)
    return batch, metrics | score(run, batch)
