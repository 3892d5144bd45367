"""`megarl report` on hand-written run folders: the page, its embedded PNGs (every logged metric
drawn: named panels, then the rest by prefix), notes for the panels the run has no metrics for,
the summary, the configuration and sample generations; a missing or empty metrics file is a clear
error."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from megarl.cli import main as cli_main
from megarl.report import read_metrics
from megarl.report_panels import MAX_LINES, PANELS

pytestmark = pytest.mark.unit

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def images(page: str) -> dict[str, bytes]:
    """alt text -> decoded PNG bytes of every embedded image."""
    found = re.findall(r"<img alt='([^']+)' src='data:image/png;base64,([^']+)'>", page)
    return {alt: base64.b64decode(data) for alt, data in found}


def write_run(tmp_path, records: list[dict]) -> str:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(run)


def test_report_draws_what_the_run_logged_and_notes_the_rest(tmp_path, capsys):
    records = []
    for step in range(1, 5):
        records.append(
            {
                "step": step,
                "reward/mean": 0.1 * step,
                "actor/kl_loss": 0.01 * step,
                "actor/entropy": 3.0 - 0.1 * step,
                "response/length_mean": 20.0 + step,
                "actor/pg_clipfrac": 0.05,
                "actor/grad_norm": 1.5,
                "timing/rollout_s": 1.0,
                "timing/update_actor_s": 2.0,
                "memory/host_rss_gib": 1.2,
            }
        )
    records.append({"step": 4, "val/reward_mean": 0.5})
    run = write_run(tmp_path, [*records, {"bad line": True}])
    assert cli_main(["report", run]) == 0
    assert "report written to" in capsys.readouterr().out
    page = (tmp_path / "run" / "report.html").read_text()
    pngs = images(page)
    drawn = {
        "Reward and validation score",
        "KL",
        "Entropy",
        "Response length",
        "Clip fraction",
        "Gradient norm",
        "Phase timings",
        "Memory",
    }
    assert set(pngs) == drawn  # every metric is in a named panel: no "Other metrics"
    assert "Other metrics" not in page
    for alt, png in pngs.items():
        assert png.startswith(PNG_SIGNATURE) and len(png) > 2000, alt
    for title in ("Losses", "Reward-model accuracy", "Throughput", "SFT loss", "DPO loss"):
        assert f"<li class='skipped'>{title}: skipped, the run logged none of" in page
    assert "1 unreadable lines of metrics.jsonl skipped" in page
    assert "4 steps logged (1 to 4)" in page


def test_report_to_another_file_and_last_value_of_a_step_wins(tmp_path):
    run = write_run(
        tmp_path,
        [
            {"step": 1, "reward/mean": 0.1},
            {"step": 2, "reward/mean": 0.2},
            {"step": 2, "reward/mean": 0.3},
        ],
    )
    series, bad = read_metrics(run)
    assert series["reward/mean"] == [(1, 0.1), (2, 0.3)] and bad == 0
    out = tmp_path / "elsewhere" / "r.html"
    assert cli_main(["report", run, "--out", str(out)]) == 0
    assert set(images(out.read_text())) == {"Reward and validation score"}


def test_missing_or_empty_metrics_exit_2(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "nothing")]) == 2
    assert (
        "metrics.jsonl does not exist: pass the run's trainer.output_dir" in capsys.readouterr().err
    )
    run = write_run(tmp_path, [])
    assert cli_main(["report", run]) == 2
    assert "holds no metrics" in capsys.readouterr().err


def test_every_panel_has_a_distinct_title():
    titles = [p.title for p in PANELS]
    assert len(titles) == len(set(titles))


def test_sft_and_dpo_runs_draw_their_losses_and_every_other_metric_by_prefix(tmp_path):
    """What `megarl report` drew only timings for: SFT and DPO metrics, plus metrics no named panel
    knows (grouped by prefix, MAX_LINES a plot), one with a '$' in its name (matplotlib's math
    mode would fail on it)."""
    many = {f"custom/m{i}": float(i) for i in range(MAX_LINES + 2)}
    records = [
        {
            "step": step,
            "sft/loss": 2.0 / step,
            "dpo/loss": 0.7 - 0.1 * step,
            "dpo/reward_accuracy": 0.5 + 0.1 * step,
            "dpo/reward_margin": 0.2 * step,
            "rollout/turns_mean": 2.0,
            "rollout/budget_cut": 0.25,  # multi-turn: out of room before rollout.environment.max_turns
            "rollout/staleness_mean": 1.0,  # async
            "cost/$_per_$^": 0.01,  # as math, "_per_" fails to parse
            "lonely": 1.0,
            **many,
        }
        for step in (1, 2, 3)
    ]
    records.append({"step": 3, "val/sft_loss": 0.9, "val/dpo_reward_accuracy": 0.8})
    run = write_run(tmp_path, records)
    assert cli_main(["report", run]) == 0
    page = (tmp_path / "run" / "report.html").read_text()
    pngs = images(page)
    named = {"SFT loss", "DPO loss", "DPO reward accuracy", "DPO reward margin"}
    named |= {"Turns and tool calls", "Trajectories cut short", "Staleness (asynchronous rollout)"}
    others = {"custom (1 of 2)", "custom (2 of 2)", "cost", "lonely"}
    assert set(pngs) == named | others, sorted(pngs)
    assert all(png.startswith(PNG_SIGNATURE) for png in pngs.values())
    assert "<h2>Other metrics</h2>" in page
    # the summary: headline metrics first, last (with steps), min, max
    assert "<tr><td>sft/loss</td><td>2 (step 1)</td><td>0.6667 (step 3)</td>" in page
    assert "<td>val/dpo_reward_accuracy</td><td>0.8 (step 3)</td>" in page
    assert f"All {len(records[0]) - 1 + 2} metrics" in page


def test_the_page_shows_the_config_and_the_last_samples_of_the_run(tmp_path):
    run = Path(write_run(tmp_path, [{"step": s, "reward/mean": 0.1 * s} for s in (1, 2)]))
    page = run / "report.html"
    assert cli_main(["report", str(run)]) == 0
    text = page.read_text()
    assert "No config.yaml in the run folder" in text
    assert "None in the run folder: validation (trainer.test_freq)" in text

    (run / "config.yaml").write_text("trainer:\n  total_steps: 2  # <b>not markup</b>\n")
    (run / "validation").mkdir()
    for step, answer in ((1, "early"), (2, "late <answer>")):
        rows = [{"step": step, "prompt": "2+2?", "response": answer, "score": 1.0}]
        (run / "validation" / f"step_{step:06d}.json").write_text(json.dumps(rows))
    (run / "rollouts").mkdir()
    for step in (1, 2):
        for dp in (0, 1):
            record = {
                "group": f"g{dp}",
                "prompt": "x" * 1000,
                "response": f"step {step} rank {dp}",
                "token_level_rewards": [0.0, 0.25, 0.5],
            }
            path = run / "rollouts" / f"step_{step:06d}_dp{dp}.jsonl"
            path.write_text(json.dumps(record) + "\n" + "not json\n")
    assert cli_main(["report", str(run)]) == 0
    text = page.read_text()
    assert "total_steps: 2  # &lt;b&gt;not markup&lt;/b&gt;" in text
    assert "Validation: step_000002.json" in text and "late &lt;answer&gt;" in text
    assert "early" not in text  # the last table only
    assert "Trained on at step 2" in text
    assert "step 2 rank 0" in text and "step 2 rank 1" in text and "step 1 rank" not in text
    assert "<td class='text'>0.75</td>" in text  # the sample's reward: its token rewards' sum
    assert "x" * 600 + " [...]" in text and "x" * 601 not in text
