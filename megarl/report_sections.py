"""The parts of ``megarl report``'s page besides the plots, read from the run folder: a summary of
the metrics (first, last, best), the resolved configuration (``config.yaml``), and sample
generations (the last validation table under ``validation/``, the last dumped rollout step under
``rollouts/``). Each is left out, with a note, when the run folder does not have it."""

from __future__ import annotations

import html
import json
from pathlib import Path

from megarl.report_panels import Series

# The metrics a reader looks at first, when the run logged them (policy, SFT, DPO, RM).
HEADLINE = (
    "reward/mean",
    "val/reward_mean",
    "sft/loss",
    "val/sft_loss",
    "dpo/loss",
    "dpo/reward_accuracy",
    "val/dpo_reward_accuracy",
    "rm/accuracy",
    "val/rm_accuracy",
    "timing/step_s",
)
SAMPLES_SHOWN = 8
TEXT_CHARS = 600  # of each prompt or response shown


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _rows(series: Series, keys: list[str]) -> list[str]:
    rows = []
    for key in keys:
        points = series[key]
        values = [v for _, v in points]
        rows.append(
            f"<tr><td>{html.escape(key)}</td><td>{_fmt(points[0][1])} (step {points[0][0]})</td>"
            f"<td>{_fmt(points[-1][1])} (step {points[-1][0]})</td>"
            f"<td>{_fmt(min(values))}</td><td>{_fmt(max(values))}</td></tr>"
        )
    return rows


def summary_section(series: Series) -> str:
    """The headline metrics' first, last, min and max, and the same for every metric, folded."""
    head = "<tr><th>metric</th><th>first</th><th>last</th><th>min</th><th>max</th></tr>"
    headline = [k for k in HEADLINE if k in series]
    parts = ["<h2>Summary</h2>"]
    if headline:
        parts += ["<table>", head, *_rows(series, headline), "</table>"]
    parts += [
        f"<details><summary>All {len(series)} metrics</summary><table>",
        head,
        *_rows(series, sorted(series)),
        "</table></details>",
    ]
    return "\n".join(parts)


def config_section(run_dir: Path) -> str:
    from megarl.run.resolved_config import (
        CONFIG_FILE,
    )  # keeps the config reader off `megarl --help`

    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return f"<p class='skipped'>No {CONFIG_FILE} in the run folder (a run before megarl kept one).</p>"
    return (
        f"<details><summary>Configuration ({CONFIG_FILE}, as the run resolved it)</summary>"
        f"<pre>{html.escape(path.read_text(errors='replace'))}</pre></details>"
    )


def _short(text: object) -> str:
    s = str(text)
    return html.escape(s if len(s) <= TEXT_CHARS else s[:TEXT_CHARS] + " [...]")


def _table(rows: list[dict[str, object]], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = [
        "<tr>" + "".join(f"<td class='text'>{_short(r.get(c, ''))}</td>" for c in columns) + "</tr>"
        for r in rows
    ]
    return "\n".join(["<table>", f"<tr>{head}</tr>", *body, "</table>"])


def _last(folder: Path, pattern: str) -> list[Path]:
    """The files of the last step named ``step_<step>...`` in ``folder`` (zero-padded names)."""
    files = sorted(folder.glob(pattern)) if folder.is_dir() else []
    if not files:
        return []
    last = files[-1].name.split("_")[1].split(".")[0]
    return [f for f in files if f.name.split("_")[1].split(".")[0] == last]


def _read_jsonl(path: Path) -> list[dict[str, object]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def samples_section(run_dir: Path) -> str:
    """The last validation table and the last dumped rollout step, a few rows of each."""
    parts = ["<h2>Sample generations</h2>"]
    found = False
    for path in _last(run_dir / "validation", "step_*.json")[:1]:
        try:
            rows = [r for r in json.loads(path.read_text()) if isinstance(r, dict)]
        except ValueError:
            rows = []
        if rows:
            found = True
            parts.append(f"<h3>Validation: {html.escape(path.name)}</h3>")
            parts.append(_table(rows[:SAMPLES_SHOWN], list(rows[0])))
    dumped = [r for p in _last(run_dir / "rollouts", "step_*.jsonl") for r in _read_jsonl(p)]
    if dumped:
        found = True
        for r in dumped:
            rewards = r.get("token_level_rewards")
            if isinstance(rewards, list):
                r["reward"] = _fmt(sum(float(x) for x in rewards))
        step = _last(run_dir / "rollouts", "step_*.jsonl")[0].name.split("_")[1]
        parts.append(f"<h3>Trained on at step {int(step)} (trainer.dump_rollouts)</h3>")
        parts.append(_table(dumped[:SAMPLES_SHOWN], ["group", "prompt", "response", "reward"]))
    if not found:
        parts.append(
            "<p class='skipped'>None in the run folder: validation (trainer.test_freq) keeps its "
            "generations under validation/, trainer.dump_rollouts its samples under rollouts/.</p>"
        )
    return "\n".join(parts)
