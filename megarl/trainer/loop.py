"""The PPO/GRPO training loop. Every rank runs it (SPMD); see shared/DESIGN.md for the data flow."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from megarl.config import RunConfig
from megarl.trainer import checkpointing
from megarl.trainer.experience import build_samples, compute_experience, score_responses
from megarl.trainer.losses import make_actor_loss, make_critic_loss
from megarl.trainer.model_ops import MicroBatching, ppo_update
from megarl.trainer.run_state import RunState, reduce_metrics, setup_run, validate


@contextmanager
def timed(metrics: dict[str, float], phase: str):
    t0 = time.perf_counter()
    yield
    metrics[f"timing/{phase}_s"] = time.perf_counter() - t0


def train(cfg: RunConfig) -> dict[str, float]:
    """Run ``cfg`` to ``trainer.total_steps`` (resuming from the latest checkpoint when asked)."""
    run: RunState = setup_run(cfg)
    batching = MicroBatching(cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch)
    actor_loss = make_actor_loss(cfg.algorithm, run.roles.dims.vocab_size)
    critic_loss = make_critic_loss(cfg.critic, cfg.algorithm.loss_agg_mode)
    token_level = cfg.algorithm.loss_agg_mode == "token-mean"
    skip_nan = cfg.trainer.nan_policy == "skip"
    last: dict[str, float] = {}
    for step in range(run.start_step, cfg.trainer.total_steps):
        m: dict[str, float] = {}
        t_step = time.perf_counter()
        items = run.next_prompts()
        with timed(m, "rollout"):
            m.update(run.engine.to_rollout())
            batch = run.engine.generate([it.input_ids for it in items], run.sampling)
            run.engine.to_train()
        with timed(m, "reward"):
            scores, reward_metrics, _ = score_responses(run.rewards, items, batch, run.tokenizer)
        samples = build_samples(items, batch, scores, run.pad_id)
        with timed(m, "experience"):
            m.update(compute_experience(cfg, run.roles, samples, run.kl_ctrl, batching))
        minis = run.mini_batches(samples)
        with timed(m, "update_actor"):
            actor_hist = ppo_update(
                *run.actor_parts(),
                samples,
                minis,
                cfg.actor.ppo_epochs,
                batching,
                actor_loss,
                token_level,
                skip_nan,
            )
        if run.roles.critic is not None:
            with timed(m, "update_critic"):
                critic_hist = ppo_update(
                    *run.critic_parts(),
                    samples,
                    minis,
                    cfg.critic.ppo_epochs,
                    batching,
                    critic_loss,
                    token_level,
                    skip_nan,
                )
            m.update({f"critic/{k}" if "/" not in k else k: v for k, v in critic_hist[-1].items()})
        m.update({f"actor/{k}" if "/" not in k else k: v for k, v in actor_hist[-1].items()})
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
        final = step + 1 == cfg.trainer.total_steps
        if (cfg.trainer.save_freq and (step + 1) % cfg.trainer.save_freq == 0) or final:
            checkpointing.save(
                Path(cfg.trainer.output_dir) / "checkpoints",
                step + 1,
                run.roles,
                cfg.model.path,
                run.trainer_state(step + 1),
            )
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
