"""``megarl report RUN_DIR``: a run's curves as one self-contained HTML page (PNG plots embedded
as data URIs), drawn with matplotlib from ``RUN_DIR/metrics.jsonl``; no server, no network.

A panel whose metrics the run did not log (a GRPO run has no critic, a CPU run no GPU memory) is
left out with a note naming the metrics it looked for.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

from megarl.errors import MegarlError
from megarl.files import replace_file

Series = dict[str, list[tuple[int, float]]]  # metric -> [(step, value)], by step


@dataclass(frozen=True)
class Panel:
    """One plot: the metrics it draws, named exactly or by a prefix ending in '/'."""

    title: str
    metrics: tuple[str, ...]
    ylabel: str = ""

    def keys_in(self, series: Series) -> list[str]:
        out: list[str] = []
        for name in self.metrics:
            if name.endswith("/"):
                out += sorted(k for k in series if k.startswith(name))
            elif name in series:
                out.append(name)
        return out


PANELS = (
    Panel(
        "Reward and validation score",
        ("reward/mean", "reward/min", "reward/max", "val/reward_mean"),
        "reward",
    ),
    Panel("KL", ("actor/kl_loss", "actor/reward_kl", "actor/kl_coef"), "KL"),
    Panel("Entropy", ("actor/entropy",), "nats per token"),
    Panel("Response length", ("response/length_mean", "response/length_max"), "tokens"),
    Panel(
        "Clip fraction",
        ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac"),
        "share of tokens",
    ),
    Panel("Gradient norm", ("actor/grad_norm", "critic/grad_norm", "rm/grad_norm"), "L2 norm"),
    Panel("Losses", ("actor/pg_loss", "critic/vf_loss", "rm/loss", "val/rm_loss"), "loss"),
    Panel("Reward-model accuracy", ("rm/accuracy", "val/rm_accuracy"), "share of pairs"),
    Panel("Phase timings", ("timing/",), "seconds"),
    Panel("Throughput", ("perf/tokens_per_s",), "tokens/s"),
    Panel("Memory", ("memory/",), "GiB"),
)


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


def plot_png(panel: Panel, keys: list[str], series: Series) -> bytes:
    import matplotlib

    matplotlib.use("Agg")  # no display; safe in any process
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    ax = fig.add_subplot()
    for key in keys:
        steps, values = zip(*series[key], strict=True)
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def render(run_dir: Path, series: Series, bad_lines: int) -> str:
    steps = sorted({s for points in series.values() for s, _ in points})
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>megarl report: {html.escape(str(run_dir))}</title>",
        "<style>body{font-family:sans-serif;max-width:1400px;margin:1em auto}"
        ".plots{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0}"
        ".skipped{color:#777}</style></head><body>",
        f"<h1>megarl report: {html.escape(str(run_dir))}</h1>",
        f"<p>{len(steps)} steps logged ({steps[0]} to {steps[-1]}), {len(series)} metrics.</p>",
    ]
    if bad_lines:
        parts.append(
            f"<p class='skipped'>{bad_lines} unreadable lines of metrics.jsonl skipped.</p>"
        )
    plots, skipped = [], []
    for panel in PANELS:
        keys = panel.keys_in(series)
        if not keys:
            wanted = ", ".join(panel.metrics)
            skipped.append(
                f"<li class='skipped'>{html.escape(panel.title)}: skipped, the run logged none "
                f"of {html.escape(wanted)}</li>"
            )
            continue
        data = base64.b64encode(plot_png(panel, keys, series)).decode("ascii")
        plots.append(
            f"<figure><img alt='{html.escape(panel.title)}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{html.escape(panel.title)}</figcaption></figure>"
        )
    parts += ["<div class='plots'>", *plots, "</div>"]
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
