"""A step's rollout, phase by phase: ``to_rollout -> generate -> to_train -> rewards -> score``.

:func:`step_batch` is what the loop calls. Each draw (:func:`draw`) takes the next prompts, moves
training memory off the device and the actor's weights into the rollout engine
(:func:`to_rollout`), generates, puts the engine to sleep and brings training memory back
(:func:`to_train`), then rewards the responses. DAPO's dynamic sampling
(``algorithm.filter_groups``) is a filter around the draws
(:func:`megarl.trainer.dynamic_sampling.filter_groups`). Only then, with the rollout engine
asleep, the actor scores what the step trains on (:func:`score`): the old logprobs and the
rollout-vs-trainer mismatch, in the update's micro-batches, unless the update's own forward gives
both (:mod:`megarl.trainer.old_log_probs`).

Each phase returns its metrics, and :func:`step_batch` returns them merged for the loop.
Timings: ``timing/rollout_s`` (the transitions and generation), ``timing/reward_s``,
``timing/old_log_prob_s`` (the scoring pass, when it runs); summed over a step's draws.
"""

from __future__ import annotations

from megarl.data import PromptItem
from megarl.hybrid_engine.engine import HybridEngine, RolloutBatch, gpu_memory_metrics
from megarl.hybrid_engine.mismatch import LOGPROB_MISMATCH_REDUCTIONS
from megarl.hybrid_engine.rollout_types import SamplingConfig
from megarl.metrics import StepMetrics, declare
from megarl.run.steps import timed
from megarl.trainer.agent_rollout import agent_batch
from megarl.trainer.assembly import PolicyRun
from megarl.trainer.batch import StepBatch
from megarl.trainer.dynamic_sampling import filter_groups
from megarl.trainer.experience import score_rollout
from megarl.trainer.old_log_probs import score_old_log_probs


def to_rollout(run: PolicyRun) -> dict[str, float]:
    """The reference's and critic's memory (``param_offload``) and the actor's grads and optimizer
    state off the device, the actor's weights resharded into the rollout engine, the engine awake
    (the actor's weights leave too with ``actor.param_offload``, once the reshard has read them)."""
    r = run.rollout
    metrics = r.roles_offload.offload()
    metrics |= r.actor_memory.release()
    metrics |= r.engine.to_rollout(before_kv_cache=r.actor_memory.offload_model)
    return metrics


def to_train(run: PolicyRun) -> dict[str, float]:
    """The rollout engine asleep, then every model's training memory back on the device; the GPU
    memory in use then (empty on CPU)."""
    r = run.rollout
    r.engine.to_train()
    metrics = r.actor_memory.restore()
    metrics |= r.roles_offload.onload()
    return metrics | gpu_memory_metrics("after_sleep")


def generate(run: PolicyRun, items: list[PromptItem], sampling: SamplingConfig) -> RolloutBatch:
    """Responses to this DP rank's prompts from the awake rollout engine (no scoring); with
    ``rollout.env``, one multi-turn trajectory per sample (megarl.hybrid_engine.multi_turn); with
    ``rollout.agent``, one per agent run (megarl.trainer.agent_rollout)."""
    r = run.rollout
    if r.agent is not None:  # built with the colocated engine only (trainer.assembly)
        assert isinstance(r.engine, HybridEngine)
        return agent_batch(
            r.engine,
            r.agent,
            [dataset_row(it) for it in items],
            [it.input_ids for it in items],
            sampling,
            r.max_env_failures,
        )
    if r.turns is None:
        return r.engine.generate([it.input_ids for it in items], sampling)
    # multi-turn rollouts (turns) are built with the colocated engine only (trainer.assembly)
    assert isinstance(r.engine, HybridEngine)
    return r.engine.generate_trajectories(
        [dataset_row(it) for it in items],
        [it.input_ids for it in items],
        sampling,
        r.turns,
        r.env_runner,
        run.startup.pad_id,
        max_failed_share=r.max_env_failures,
    )


def dataset_row(item: PromptItem) -> dict[str, object]:
    """The parquet row an environment's reset reads: the schema's columns and every other one."""
    return {
        "prompt": item.prompt,
        "data_source": item.data_source,
        "reward_model": item.reward_model,
        "extra_info": item.extra_info,
        **item.extra,
    }


def draw(run: PolicyRun) -> tuple[StepBatch, StepMetrics]:
    """The next batch of prompts rolled out and rewarded, the rollout engine awake only between
    :func:`to_rollout` and :func:`to_train`; the draw's memory moves and timings."""
    items = run.data.batches.next()
    with timed("rollout") as rollout_time:
        moves = declare(to_rollout(run))
        rollout = generate(run, items, run.rollout.sampling)
        moves |= declare(to_train(run))
    s = run.startup
    with timed("reward") as reward_time:
        samples, scores, reward_metrics, _ = score_rollout(
            run.rewards, s.tokenizer, s.pad_id, items, rollout, run.batching
        )
    reward_metrics |= rollout.metrics  # multi-turn: the step's rollout/* (turns, tools ...)
    batch = StepBatch(samples, scores, list(rollout.output.finish_reasons), reward_metrics)
    return batch, moves | rollout_time.metrics() | reward_time.metrics()


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


def step_batch(run: PolicyRun) -> tuple[StepBatch, StepMetrics]:
    """This rank's batch of the step: drawn (``to_rollout -> generate -> to_train -> rewards``,
    filtered by dynamic sampling when ``algorithm.filter_groups``), then scored by the actor;
    the phases' timings, memory moves, dynamic-sampling counts and the rollout mismatch."""
    a = run.cfg.algorithm
    if a.filter_groups:
        target = run.cfg.data.train_batch_size  # the step's groups, over every DP rank
        remote = run.rollout.remote  # async: the rollout group draws again when told to
        decided = remote.draws_decided if remote is not None else None
        batch, metrics = filter_groups(lambda: draw(run), a, target, run.startup.pad_id, decided)
    else:
        batch, metrics = draw(run)
    return batch, metrics | score(run, batch)
