"""bench/learn.py's report: the per-seed table, the summary (the time each side trains to reach
the accuracy TRL ends with, their ratio, the seeds' means) and the curves' picture.

Everything here reads each side's ``curve``: its validations on the training-clock cadence both
sides share (bench/_validation_cadence.py), so that "time to reach" is sampled alike on both; a
side's other validations (megarl validates every step) are stored beside it, not used."""

from __future__ import annotations

from pathlib import Path

SIDES = ("megarl", "trl")
# accuracies whose first training minute per side and seed the summary lists as well
ACCURACY_TARGETS = (0.6, 0.7)


def median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if v else float("nan")


def print_table(seed: int, results: dict[str, dict]) -> None:
    print(f"\nseed {seed}: validation over training time (start-up and validation excluded)")
    print(f"  {'side':<8} {'minutes':>8} {'steps':>6} {'val score':>10} {'val accuracy':>13}")
    for name, r in results.items():
        if "failed" in r:
            print(f"  {name:<8} failed: {r['failed']}")
            continue
        for p in r["curve"]:  # on the shared cadence
            print(
                f"  {name:<8} {p['clock_s'] / 60:>8.2f} {p['step']:>6} {p['score']:>10.3f} "
                f"{p['accuracy']:>13.3f}"
            )
        print(f"  {name:<8} median step {median(r['step_s']):.1f} s over {len(r['step_s'])} steps")


def summarize(results: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for name, r in results.items():
        if "failed" in r:
            continue
        first, last = r["curve"][0], r["curve"][-1]
        out[name] = {
            "baseline_score": first["score"],
            "baseline_accuracy": first["accuracy"],
            "final_score": last["score"],
            "final_accuracy": last["accuracy"],
            "final_minutes": last["clock_s"] / 60,
            "steps": last["step"],
            "median_step_s": median(r["step_s"]),
        }
    return out


def time_to(curve: list[dict], accuracy: float) -> float | None:
    """Training seconds at the first validation reaching ``accuracy`` (None: never)."""
    for point in curve:
        if point["accuracy"] >= accuracy - 1e-9:
            return point["clock_s"]
    return None


def time_to_trl_final_ratio(results: dict[str, dict]) -> float | None:
    """megarl's training time to TRL's final accuracy over TRL's own; None where TRL did not
    improve (its time is 0), either side failed, or megarl never reached it."""
    if any("failed" in results.get(side, {"failed": "not run"}) for side in SIDES):
        return None
    target = results["trl"]["curve"][-1]["accuracy"]
    trl_s, megarl_s = (
        time_to(results["trl"]["curve"], target),
        time_to(results["megarl"]["curve"], target),
    )
    if not trl_s or megarl_s is None:
        return None
    return megarl_s / trl_s


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def overall_summary(runs: dict[str, dict]) -> dict[str, object]:
    """The seeds' mean start and end accuracy per side, and the mean time ratio (the keys the
    README and the issue tracker read)."""
    out: dict[str, object] = {}
    for side in SIDES:
        done = [d["summary"][side] for d in runs.values() if side in d["summary"]]
        if done:
            out[side] = {
                "accuracy_start": mean([d["baseline_accuracy"] for d in done]),
                "accuracy_end": mean([d["final_accuracy"] for d in done]),
                "minutes_end": mean([d["final_minutes"] for d in done]),
                "seeds": len(done),
            }
    ratios = [time_to_trl_final_ratio(d["runs"]) for d in runs.values()]
    # a mean over the seeds where megarl got there would hide the ones where it did not
    reached = [r for r in ratios if r is not None]
    out["time_to_trl_final_ratio"] = mean(reached) if len(reached) == len(ratios) else None
    out["time_to_trl_final_ratio_per_seed"] = ratios
    out["minutes_to_accuracy"] = {
        f"{target:g}": {
            side: [
                None if (t := time_to(d["runs"][side].get("curve", []), target)) is None else t / 60
                for d in runs.values()
                if side in d["runs"]
            ]
            for side in SIDES
        }
        for target in ACCURACY_TARGETS
    }
    return out


def add_samples(runs: dict[str, dict], samples_per_step: int) -> None:
    for d in runs.values():
        for r in d["runs"].values():
            for point in [*r.get("validations", []), *r.get("curve", [])]:
                point["samples"] = point["step"] * samples_per_step


def plot(runs: dict[str, dict], path: Path, title: str) -> None:
    """Held-out accuracy against training minutes and against samples, every side and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = {"megarl": "tab:blue", "trl": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    for i, (seed, d) in enumerate(sorted(runs.items())):
        for side, r in d["runs"].items():
            curve = r.get("curve") or []
            if not curve:
                continue
            accuracy = [p["accuracy"] for p in curve]
            style = dict(color=colors.get(side), linestyle=styles[i % 4], marker="o", ms=3)
            label = f"{side}, seed {seed}"
            axes[0].plot([p["clock_s"] / 60 for p in curve], accuracy, label=label, **style)
            axes[1].plot([p.get("samples", 0) for p in curve], accuracy, label=label, **style)
    axes[0].set_xlabel("training minutes (start-up and validation excluded)")
    axes[1].set_xlabel("training samples")
    axes[0].set_ylabel("held-out accuracy (greedy)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
