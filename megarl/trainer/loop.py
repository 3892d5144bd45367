"""The PPO/GRPO training loop. Every rank runs it (SPMD); see shared/DESIGN.md for the data flow."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from megarl.config import RunConfig
from megarl.trainer import checkpointing, watchdog
from megarl.trainer.experience import compute_experience, score_rollout
from megarl.trainer.guards import RunGuards
from megarl.trainer.losses import make_actor_loss, make_critic_loss
from megarl.trainer.model_ops import MicroBatching, ppo_update, rollout_is_finite
from megarl.trainer.profiling import StepProfiler
from megarl.trainer.run_state import RunState, reduce_metrics, setup_run, validate


@contextmanager
def timed(metrics: dict[str, float], phase: str):
    t0 = time.perf_counter()
    with watchdog.phase(phase):
        yield
    metrics[f"timing/{phase}_s"] = time.perf_counter() - t0


@dataclass(frozen=True)
class Updates:
    """How the models are updated from a batch of samples (fixed for the run)."""

    actor_loss: Callable
    critic_loss: Callable
    token_level: bool
    batching: MicroBatching
    skip_non_finite: bool


def update_models(run: RunState, samples, u: Updates, m: dict[str, float]) -> dict[str, float]:
    """Actor (and critic) PPO updates over the mini-batches; their last step's metrics."""
    cfg = run.cfg
    minis = run.mini_batches(samples)
    out: dict[str, float] = {}
    parts = [("actor", run.actor_parts(), u.actor_loss, cfg.actor.ppo_epochs)]
    if run.roles.critic is not None:
        parts.append(("critic", run.critic_parts(), u.critic_loss, cfg.critic.ppo_epochs))
    for role, (ddp, opt, sched), loss, epochs in parts:
        with timed(m, f"update_{role}"):
            hist = ppo_update(
                ddp,
                opt,
                sched,
                samples,
                minis,
                epochs,
                u.batching,
                loss,
                u.token_level,
                u.skip_non_finite,
            )
        out.update({f"{role}/{k}" if "/" not in k else k: v for k, v in hist[-1].items()})
    return out


def train(cfg: RunConfig) -> dict[str, float]:
    """Run ``cfg`` to ``trainer.total_steps`` (resuming from the latest checkpoint when asked)."""
    profiler = StepProfiler.from_config(cfg.trainer)  # bad profile_steps fail before setup
    guards = RunGuards()  # preemption signals, hang watchdog
    run: RunState = setup_run(cfg)
    guards.start(cfg.trainer.hang_timeout_s)
    batching = MicroBatching(cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch)
    skip_nan = cfg.trainer.nan_policy == "skip"
    updates = Updates(
        actor_loss=make_actor_loss(cfg.algorithm, run.roles.dims.vocab_size),
        critic_loss=make_critic_loss(cfg.critic, cfg.algorithm.loss_agg_mode),
        token_level=cfg.algorithm.loss_agg_mode == "token-mean",
        batching=batching,
        skip_non_finite=skip_nan,
    )
    last: dict[str, float] = {}
    # Each step's body runs under torch.profiler when trainer.profile_steps lists step + 1.
    for step in profiler.iterate(range(run.start_step, cfg.trainer.total_steps)):
        guards.begin_step(step)
        m: dict[str, float] = {}
        t_step = time.perf_counter()
        items = run.next_prompts()
        with timed(m, "rollout"):
            m.update(run.engine.to_rollout())
            batch = run.engine.generate([it.input_ids for it in items], run.sampling)
            run.engine.to_train()
        with timed(m, "reward"):
            samples, scores, reward_metrics, _ = score_rollout(run, items, batch, batching)
        if rollout_is_finite(samples, skip_nan):
            with timed(m, "experience"):
                m.update(compute_experience(cfg, run.roles, samples, run.kl_ctrl, batching))
            m.update(update_models(run, samples, updates, m))
        else:  # nan_policy=skip: no update from a rollout the actor scored NaN/inf
            m["actor/skipped_non_finite"] = 1.0
        m.update(batch.metrics)
        m.update(run.batch_metrics(samples, scores, batch, reward_metrics))
        m["timing/step_s"] = m["perf/step_s"] = time.perf_counter() - t_step
        m["perf/tokens_per_s"] = run.tokens_in(samples) / m["timing/step_s"]
        last = reduce_metrics(m)
        run.tracker.log_metrics(last, step + 1)
        run.tracker.progress(step, cfg.trainer.total_steps, last, run.start_step)
        run.history.append(last)
        if cfg.trainer.test_freq and (step + 1) % cfg.trainer.test_freq == 0:
            run.tracker.log_metrics(validate(run, step + 1), step + 1)
        stop = guards.should_stop(step)
        final = step + 1 == cfg.trainer.total_steps
        if (cfg.trainer.save_freq and (step + 1) % cfg.trainer.save_freq == 0) or final or stop:
            saved = checkpointing.save(
                Path(cfg.trainer.output_dir) / "checkpoints",
                step + 1,
                run.roles,
                cfg.model.path,
                run.trainer_state(step + 1),
                keep_last=cfg.trainer.keep_last,
                keep_every=cfg.trainer.keep_every,
            )
        if stop:
            guards.report_stop(step + 1, str(saved))
            break
    guards.close()
    run.finish()
    return last


def main_loop_summary(history: list[dict[str, float]]) -> str:
    if not history:
        return "no steps run"
    first, last = (
        history[0].get("reward/mean", float("nan")),
        history[-1].get("reward/mean", float("nan")),
    )
    return f"reward/mean: first step {first:.4f}, last step {last:.4f} over {len(history)} steps"


__all__ = ["main_loop_summary", "train"]
