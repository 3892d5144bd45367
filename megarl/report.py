"""``megarl report RUN_DIR``: a run's curves as one self-contained HTML page (PNG plots embedded
as data URIs), drawn with matplotlib from ``RUN_DIR/metrics.jsonl``; no server, no network.

Every logged metric is drawn: the named panels of :mod:`megarl.report_panels` first (a panel the
run logged nothing for is listed with the metrics it looked for), then the rest by prefix. Below
the plots: a summary, the run's configuration and sample generations
(:mod:`megarl.report_sections`).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path

from megarl.errors import MegarlError
from megarl.files import replace_file
from megarl.report_panels import PANELS, Panel, Series, other_panels
from megarl.report_sections import config_section, samples_section, summary_section


def read_metrics(run_dir: str | Path) -> tuple[Series, int]:
    """Every numeric metric of ``run_dir/metrics.jsonl`` by step, and the count of unreadable
    lines. A step logged twice (a resumed run) keeps its last value."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise MegarlError(
            f"{path} does not exist: pass the run's trainer.output_dir (where training writes "
            "metrics.jsonl)"
        )
    by_key: dict[str, dict[int, float]] = {}
    bad = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                by_key.setdefault(key, {})[step] = float(value)
    if not by_key:
        raise MegarlError(f"{path} holds no metrics: the run logged no step yet")
    series = {k: sorted(v.items()) for k, v in by_key.items()}
    return series, bad


def _literal(text: str) -> str:
    """Text matplotlib shows as written: a '$' would start its math mode (and a lone one fail)."""
    return text.replace("$", r"\$")


def plot_png(panel: Panel, keys: list[str], series: Series) -> bytes:
    import matplotlib

    matplotlib.use("Agg")  # no display; safe in any process
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    ax = fig.add_subplot()
    for key in keys:
        steps, values = zip(*series[key], strict=True)
        ax.plot(
            steps,
            values,
            marker="o" if len(steps) < 30 else None,
            markersize=3,
            label=_literal(key),
        )
    ax.set_title(_literal(panel.title))
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(_literal(panel.ylabel))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _figure(panel: Panel, keys: list[str], series: Series) -> str:
    data = base64.b64encode(plot_png(panel, keys, series)).decode("ascii")
    title = html.escape(panel.title, quote=True)
    return (
        f"<figure><img alt='{title}' src='data:image/png;base64,{data}'>"
        f"<figcaption>{title}</figcaption></figure>"
    )


def render(run_dir: Path, series: Series, bad_lines: int) -> str:
    steps = sorted({s for points in series.values() for s, _ in points})
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>megarl report: {html.escape(str(run_dir))}</title>",
        "<style>body{font-family:sans-serif;max-width:1400px;margin:1em auto}"
        ".plots{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0}"
        ".skipped{color:#777}table{border-collapse:collapse;font-size:small}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}"
        "td.text{white-space:pre-wrap;max-width:600px}</style></head><body>",
        f"<h1>megarl report: {html.escape(str(run_dir))}</h1>",
        f"<p>{len(steps)} steps logged ({steps[0]} to {steps[-1]}), {len(series)} metrics.</p>",
    ]
    if bad_lines:
        parts.append(
            f"<p class='skipped'>{bad_lines} unreadable lines of metrics.jsonl skipped.</p>"
        )
    plots, skipped, drawn = [], [], set()
    for panel in PANELS:
        keys = panel.keys_in(series)
        if not keys:
            wanted = ", ".join(panel.metrics)
            skipped.append(
                f"<li class='skipped'>{html.escape(panel.title)}: skipped, the run logged none "
                f"of {html.escape(wanted)}</li>"
            )
            continue
        drawn.update(keys)
        plots.append(_figure(panel, keys, series))
    others = [_figure(panel, keys, series) for panel, keys in other_panels(series, drawn)]
    parts += ["<div class='plots'>", *plots, "</div>"]
    if others:
        parts += ["<h2>Other metrics</h2><div class='plots'>", *others, "</div>"]
    parts += [summary_section(series), config_section(run_dir), samples_section(run_dir)]
    if skipped:
        parts += ["<h2>Not plotted</h2><ul>", *skipped, "</ul>"]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``run_dir/report.html``)."""
    run = Path(run_dir)
    series, bad = read_metrics(run)
    target = Path(out) if out is not None else run / "report.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    return replace_file(target, render(run, series, bad))
