"""`megarl report` on a hand-written metrics.jsonl: the page, its embedded PNGs, and notes for
the panels the run has no metrics for; a missing or empty metrics file is a clear error."""

from __future__ import annotations

import base64
import json
import re

import pytest

from megarl.cli import main as cli_main
from megarl.report import PANELS, read_metrics

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
    assert set(pngs) == drawn
    for alt, png in pngs.items():
        assert png.startswith(PNG_SIGNATURE) and len(png) > 2000, alt
    for title in ("Losses", "Reward-model accuracy", "Throughput"):
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
