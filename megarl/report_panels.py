"""What ``megarl report`` draws: named panels for the metrics every kind of run logs (policy,
SFT, DPO, reward model, multi-turn), then one panel per metric prefix for whatever else the run
logged, so that no logged metric is left out of the page."""

from __future__ import annotations

from dataclasses import dataclass

Series = dict[str, list[tuple[int, float]]]  # metric -> [(step, value)], by step

# Lines per automatic panel: more would make the legend unreadable.
MAX_LINES = 6


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
    Panel("SFT loss", ("sft/loss", "val/sft_loss"), "nats per token"),
    Panel("SFT token accuracy", ("val/sft_token_accuracy",), "share of tokens"),
    Panel("DPO loss", ("dpo/loss", "val/dpo_loss"), "loss"),
    Panel(
        "DPO reward accuracy", ("dpo/reward_accuracy", "val/dpo_reward_accuracy"), "share of pairs"
    ),
    Panel("DPO reward margin", ("dpo/reward_margin", "val/dpo_reward_margin"), "implicit reward"),
    Panel(
        "Turns and tool calls",
        ("rollout/turns_mean", "rollout/tool_calls_mean", "val/turns_mean", "val/tool_calls_mean"),
        "per trajectory",
    ),
    Panel(
        "Trajectories cut short",
        ("rollout/truncated", "rollout/budget_cut"),
        "share of trajectories",
    ),
    Panel(
        "Staleness (asynchronous rollout)",
        ("rollout/staleness_mean", "rollout/staleness_max", "rollout/mixed_version_frac"),
        "policy versions behind",
    ),
    Panel(
        "Rollout vs trainer logprobs",
        ("rollout/logprob_diff_mean", "rollout/logprob_diff_max"),
        "|difference|",
    ),
    Panel("Phase timings", ("timing/",), "seconds"),
    Panel("Throughput", ("perf/tokens_per_s",), "tokens/s"),
    Panel("Memory", ("memory/",), "GiB"),
)


def other_panels(series: Series, drawn: set[str]) -> list[tuple[Panel, list[str]]]:
    """Panels for the metrics no named panel drew: grouped by the prefix before the first '/'
    (a key without one is its own group), at most :data:`MAX_LINES` metrics per panel."""
    groups: dict[str, list[str]] = {}
    for key in sorted(series):
        if key not in drawn:
            groups.setdefault(key.split("/", 1)[0], []).append(key)
    out: list[tuple[Panel, list[str]]] = []
    for prefix, keys in groups.items():
        chunks = [keys[i : i + MAX_LINES] for i in range(0, len(keys), MAX_LINES)]
        for n, chunk in enumerate(chunks, start=1):
            part = f" ({n} of {len(chunks)})" if len(chunks) > 1 else ""
            out.append((Panel(f"{prefix}{part}", tuple(chunk)), chunk))
    return out
