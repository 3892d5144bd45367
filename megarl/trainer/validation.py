"""Validation over the whole validation set: rollouts of every prompt (greedy, or
``rollout.sampling.val_n`` samples at ``rollout.sampling.val_temperature``), scored by the run's reward, reported
per ``data_source``:

- ``val/<source>/mean@k``: mean score over all k samples of all prompts;
- ``val/<source>/best@k``: mean over prompts of the best of its k scores;
- ``val/<source>/pass@k``: share of prompts with at least one sample scoring
  ``>= trainer.val_pass_score`` (1.0: a correct GSM8K answer);

plus ``val/reward_mean`` over all sources, and a table of sample generations (with
``rollout.env``, the whole conversation of each). The prompts and their responses come from the
run's rollout source (:meth:`~megarl.trainer.rollout_source.RolloutSource.validation_batches`). (Checks of the config itself are
:func:`megarl.config.validate`.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from megarl import parallel
from megarl.trainer.assembly import PolicyRun
from megarl.trainer.experience import score_rollout

MAX_TABLE_ROWS = 32
MAX_CONVERSATION = 4000  # characters of a multi-turn conversation in the table


def conversation_text(messages: Sequence[dict]) -> str:
    """A conversation as ``[role] content`` blocks, one per message."""
    return "\n".join(f"[{m.get('role')}] {m.get('content', '')}" for m in messages)


def opening_text(messages: Sequence[dict]) -> str:
    """What the model saw before its first reply: the messages before the first assistant one
    (with ``rollout.env``, the environment's opening, not the dataset's prompt)."""
    first_reply = next(
        (i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages)
    )
    return conversation_text(messages[:first_reply])


@dataclass(frozen=True)
class ValRecord:
    data_source: str
    prompt: Hashable  # one prompt of the validation set (its samples share it)
    score: float
    turns: int | None = None  # multi-turn: the trajectory's model turns and tool calls
    tool_calls: float = 0.0


def validation_metrics(records: Sequence[ValRecord], k: int, pass_score: float) -> dict[str, float]:
    """Per-source mean@k, best@k, pass@k over ``records`` (k samples per prompt), and the mean."""
    by_prompt: dict[tuple[str, Hashable], list[float]] = defaultdict(list)
    for r in records:
        by_prompt[(r.data_source, r.prompt)].append(r.score)
    per_source: dict[str, list[list[float]]] = defaultdict(list)
    for (source, _), scores in by_prompt.items():
        per_source[source].append(scores)
    out: dict[str, float] = {}
    for source, prompts in sorted(per_source.items()):
        flat = [s for scores in prompts for s in scores]
        out[f"val/{source}/mean@{k}"] = sum(flat) / len(flat)
        out[f"val/{source}/best@{k}"] = sum(max(s) for s in prompts) / len(prompts)
        out[f"val/{source}/pass@{k}"] = sum(max(s) >= pass_score for s in prompts) / len(prompts)
        out[f"val/{source}/prompts"] = float(len(prompts))
    if records:
        out["val/reward_mean"] = sum(r.score for r in records) / len(records)
    multi = [r for r in records if r.turns is not None]
    if multi:
        out["val/turns_mean"] = sum(r.turns or 0 for r in multi) / len(multi)
        out["val/tool_calls_mean"] = sum(r.tool_calls for r in multi) / len(multi)
    return out


def _gather_dp(records: list[ValRecord]) -> list[ValRecord]:
    """All data-parallel ranks' records, on every rank."""
    group = parallel.dp_group()
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, records, group=group)
    return [r for part in parts for r in part]


def validation_rollout(run: PolicyRun, step: int, samples_per_prompt: int) -> dict[str, float]:
    """One pass over the validation set, ``samples_per_prompt`` a prompt (``rollout.sampling.val_n``); its
    metrics (the same on every rank; collective) and, on rank 0, a table of generations logged
    as ``validation/step_<step>.json``."""
    if not run.rollout.has_validation:
        return {}
    s = run.startup
    records: list[ValRecord] = []
    table: list[dict[str, str | float | int]] = []
    # the same number of batches on every rank (maybe empty), from the rollout source
    for items, batch in run.rollout.validation_batches():
        if not batch.trajectories:
            continue
        _, scores, _, texts = score_rollout(
            run.rewards, s.tokenizer, s.pad_id, items, batch, run.batching, shaping=False
        )
        rows = zip(batch.prompt_index, texts, scores.tolist(), strict=True)
        for k, (i, text, score) in enumerate(rows):
            item = items[i]
            t = batch.trajectories[k] if batch.conversations else None
            records.append(
                ValRecord(
                    item.data_source,
                    item.uid,
                    float(score),
                    turns=None if t is None else t.turns,
                    tool_calls=0.0 if t is None else t.metrics.get("tool_calls", 0.0),
                )
            )
            if len(table) < MAX_TABLE_ROWS:
                row: dict[str, str | float | int] = {
                    "step": step,
                    "data_source": item.data_source,
                    # what the model saw: with an environment, its opening messages
                    "prompt": (str(item.prompt) if t is None else opening_text(t.messages))[:500],
                    "response": text[:1000],
                    "score": float(score),
                }
                if t is not None:  # multi-turn: the whole conversation
                    row["conversation"] = conversation_text(t.messages)[:MAX_CONVERSATION]
                    row["turns"] = t.turns
                    row["finish"] = t.finish or ""
                table.append(row)
    metrics = validation_metrics(
        _gather_dp(records), samples_per_prompt, run.trainer.val_pass_score
    )
    run.tracker.log_table(table, f"validation/step_{step:06d}.json")
    return metrics
