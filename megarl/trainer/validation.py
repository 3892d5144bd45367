"""Validation rollouts (``trainer.test_freq``): greedy responses to one validation batch, scored
like training rollouts; their mean reward and a table of generations go to the tracker.
(Checks of the config itself are :func:`megarl.config.validate`.)"""

from __future__ import annotations

from megarl.metrics import mean, reduce_metrics
from megarl.trainer.assembly import PolicyRun
from megarl.trainer.experience import score_rollout


def validation_rollout(run: PolicyRun, step: int) -> dict[str, float]:
    """``val/reward_mean`` over one validation batch (the same on every rank; collective)."""
    if run.data.val is None:
        return {}
    items = next(iter(run.data.val))
    engine = run.rollout.engine
    engine.to_rollout()
    batch = engine.generate(
        [it.input_ids for it in items], run.rollout.val_sampling, score_with_actor=False
    )
    engine.to_train()
    _, scores, _, texts = score_rollout(
        run.rewards, run.startup.tokenizer, run.startup.pad_id, items, batch, run.batching
    )
    metrics = reduce_metrics({"val/reward_mean": mean(scores.mean())})
    rows = [
        {
            "step": step,
            "prompt": str(items[i].prompt)[:500],
            "response": text[:1000],
            "score": float(s),
        }
        for i, text, s in zip(batch.output.prompt_index, texts, scores.tolist(), strict=True)
    ]
    run.tracker.log_table(rows, f"validation/step_{step:06d}.json")
    return metrics
