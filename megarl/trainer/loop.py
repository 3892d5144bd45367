"""The PPO/GRPO training loop. Every rank runs it (SPMD); see docs/architecture.md for the data flow.

The loop holds the run config and hands each phase its sections; it reaches the rollout only
through ``run.rollout``, a :class:`~megarl.trainer.rollout_source.RolloutSource` (colocated or
asynchronous): the step's batch (:func:`~megarl.trainer.rollout.step_batch`), the weights
published after the update, its data's counters, validation and its checkpoint state.
"""

from __future__ import annotations

import time

from megarl.config import RunConfig
from megarl.metrics import declare, mean
from megarl.run.guards import RunGuards
from megarl.run.resume import save_due
from megarl.run.steps import log_step, summary, timed
from megarl.trainer.assembly import setup_run
from megarl.trainer.dp_balance import balance_over_data_parallel
from megarl.trainer.experience import compute_experience
from megarl.trainer.memory_metrics import MEMORY_REDUCTIONS, memory_metrics
from megarl.trainer.model_ops import rollout_is_finite
from megarl.trainer.profiling import StepProfiler
from megarl.trainer.rollout import step_batch
from megarl.trainer.rollout_dump import dump_rollout
from megarl.trainer.routing_metrics import routing_metrics
from megarl.trainer.step_metrics import rollout_metrics, tokens_in
from megarl.trainer.updates import update_models
from megarl.trainer.validation import validation_rollout


def train(cfg: RunConfig) -> dict[str, float]:
    """Run ``cfg`` to ``trainer.total_steps`` (resuming from the latest checkpoint when asked)."""
    profiler = StepProfiler.from_config(cfg.trainer)  # bad profile_steps fail before setup
    guards = RunGuards()  # preemption signals (honoured at step ends), hang watchdog
    run = setup_run(cfg)
    guards.start(cfg.trainer.hang_timeout_s)
    tracker, first = run.tracker, run.resumed.step
    history, last = list(run.resumed.history), {}
    tracker.begin()
    if cfg.trainer.val_before_train and first == 0:
        tracker.log_metrics(validation_rollout(run, 0, cfg.rollout.sampling.val_n), 0)
    # Each step's body runs under torch.profiler when trainer.profile_steps lists step + 1.
    for step in profiler.iterate(range(first, cfg.trainer.total_steps)):
        guards.begin_step(step)
        t_step = time.perf_counter()
        # Each phase returns its metrics; the step's are theirs merged here, in phase order.
        # the rollout source's next batch -> rewards (DAPO's filter around it) -> score
        batch, m = step_batch(run, cfg.algorithm, cfg.data.train_batch_size)
        if cfg.actor.balance_dp_tokens:
            batch.samples, batch.scores, balance = balance_over_data_parallel(
                batch.samples, batch.scores, run.startup.pad_id
            )
            m.update(declare(balance))
        samples = batch.samples
        if rollout_is_finite(samples, cfg.trainer.nan_policy == "skip"):
            with timed("experience") as took:
                m.update(
                    compute_experience(run.spec, run.roles, samples, run.kl_ctrl, run.batching)
                )
            m.update(took.metrics())
            m.update(update_models(run, samples, cfg.actor.ppo_epochs, cfg.critic.ppo_epochs))
            run.rollout.publish_weights()
            m.update(routing_metrics(run.roles))
            if cfg.trainer.dump_rollouts:
                dump_rollout(cfg.trainer.output_dir, step + 1, samples, run.startup.tokenizer)
        else:  # nan_policy=skip: no update from a rollout the actor scored NaN/inf
            m["actor/skipped_non_finite"] = mean(1.0)
        m.update(rollout_metrics(batch, run.rollout.data_metrics()))
        m["timing/step_s"] = mean(time.perf_counter() - t_step)
        m["perf/tokens_per_s"] = mean(
            tokens_in(samples, run.startup.layout.dp) / m["timing/step_s"].value
        )
        m.update(declare(memory_metrics(), MEMORY_REDUCTIONS))
        last = log_step(tracker, history, m, step, cfg.trainer.total_steps, first)
        if cfg.trainer.test_freq and (step + 1) % cfg.trainer.test_freq == 0:
            tracker.log_metrics(
                validation_rollout(run, step + 1, cfg.rollout.sampling.val_n), step + 1
            )
        # a stop signal on any rank (SIGTERM, SIGUSR1, Ctrl-C): checkpoint, then end the run
        if guards.end_step(
            step, save_due(cfg.trainer, step + 1), lambda s: run.save_checkpoint(s, history)
        ):
            break
    guards.close()
    if run.startup.rank == 0:
        print(main_loop_summary(history), flush=True)
    run.close()
    return last


def main_loop_summary(history: list[dict[str, float]]) -> str:
    return summary(history, "reward/mean")


__all__ = ["main_loop_summary", "train"]
