"""The step time of colocated vs asynchronous training at any split of the devices (pure).

A colocated step runs its phases one after the other on every device::

    colocated = generate(G) + switch + train(G)

where ``switch`` is what moving between the two costs (reshard into the rollout engine, vLLM's
wake-up and sleep, offloads). An asynchronous run gives ``R`` devices to the rollout group and
``T = G - R`` to the trainers; batch ``s`` may be generated once weights of version
``s - max_staleness`` exist, and each optimizer step ends with a weight broadcast (``sync``),
which the rollout engines load between batches (``load``). :func:`simulate_async` runs that
schedule step by step (an event simulation, exact for constant phase times), so one formula
covers the serial case (staleness 0: ``generate(R) + load + train(T) + sync``) and the
overlapped one (staleness >= 1: about ``max(generate(R) + load, train(T) + sync)``), start-up
and which version each batch is generated with (the predicted ``rollout/staleness_mean``).

How a phase's time changes with its devices is a :class:`Scaling`: :class:`MeasuredScaling`
scales times measured on one run by ``(devices_measured / devices) ** exponent`` (1: the work is
split evenly, as data parallelism does; below 1 when fewer devices work more efficiently, e.g.
decoding more sequences per engine reads each weight once for more tokens, or when fixed
per-step costs dominate); :meth:`MeasuredScaling.fitted` takes the exponents from two colocated
runs on different device counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from megarl.models.dims import ModelDims
from megarl.parallel import ParallelLayout
from megarl.plan.cost import rollout_time, step_time
from megarl.plan.hardware import Cluster
from megarl.plan.memory import Numerics, Options
from megarl.plan.workload import Workload


class Scaling(Protocol):
    """Seconds of one step's phases on a given number of devices."""

    def generate_s(self, devices: int) -> float: ...

    def train_s(self, devices: int) -> float: ...


@dataclass(frozen=True)
class PhaseTimes:
    """One step's phases, measured on a colocated run over ``devices`` devices (seconds)."""

    devices: int
    generate_s: float  # the rollout engines' generation (all engines at once)
    train_s: float  # everything the trainers do with a batch: scoring, rewards, updates
    switch_s: float  # colocated only: reshard into the rollout engine, wake-up, sleep, offloads
    tokens: float = 0.0  # tokens (prompt + response) trained per step, for tokens/s

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        for name in ("generate_s", "train_s", "switch_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_metrics(
        cls, metrics: Sequence[Mapping[str, float]], devices: int, skip: int = 1
    ) -> PhaseTimes:
        """The medians over a colocated run's step records (``metrics.jsonl`` lines), after
        ``skip`` warm-up steps. ``timing/rollout_s`` holds the reshard (``reshard/seconds``),
        generation and, when separate, the old-logprob scoring (``timing/old_log_prob_s``),
        which belongs to the trainers' work."""
        steps = [m for m in metrics if "timing/step_s" in m][skip:]
        if not steps:
            raise ValueError("no step records with timing/step_s (after the warm-up steps)")

        def median(values: list[float]) -> float:
            ordered = sorted(values)
            mid = len(ordered) // 2
            return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

        def get(m: Mapping[str, float], key: str) -> float:
            value = m.get(key, 0.0)
            return 0.0 if value is None or math.isnan(value) else float(value)

        switch = [get(m, "reshard/seconds") for m in steps]
        score = [get(m, "timing/old_log_prob_s") for m in steps]
        rollout = [get(m, "timing/rollout_s") for m in steps]
        step = [get(m, "timing/step_s") for m in steps]
        tokens = [get(m, "perf/tokens_per_s") * get(m, "timing/step_s") for m in steps]
        return cls(
            devices=devices,
            generate_s=median([r - w - s for r, w, s in zip(rollout, switch, score, strict=True)]),
            train_s=median([t - r + s for t, r, s in zip(step, rollout, score, strict=True)]),
            switch_s=median(switch),
            tokens=median(tokens),
        )


@dataclass(frozen=True)
class MeasuredScaling:
    """Measured phase times scaled to other device counts by a power law per phase."""

    measured: PhaseTimes
    rollout_exponent: float = 1.0
    train_exponent: float = 1.0

    @classmethod
    def fitted(cls, wide: PhaseTimes, narrow: PhaseTimes) -> MeasuredScaling:
        """The exponents that two colocated runs of the same task on different device counts
        measured: ``log(t_narrow / t_wide) / log(d_wide / d_narrow)`` per phase, clamped to
        [0, 2]. Where a step's fixed costs (launch overheads, collectives, a small model's
        per-step work) dominate, doubling the devices does not halve a phase and the fitted
        exponent is well below 1; scaling the work evenly (exponent 1) would overestimate what
        fewer devices need."""
        if wide.devices == narrow.devices:
            raise ValueError("the two runs need different device counts to fit an exponent")
        if wide.devices < narrow.devices:
            wide, narrow = narrow, wide
        spread = math.log(wide.devices / narrow.devices)

        def exponent(t_wide: float, t_narrow: float) -> float:
            if t_wide <= 0 or t_narrow <= 0:
                return 1.0  # nothing measured: the even split
            return min(2.0, max(0.0, math.log(t_narrow / t_wide) / spread))

        return cls(
            wide,
            rollout_exponent=exponent(wide.generate_s, narrow.generate_s),
            train_exponent=exponent(wide.train_s, narrow.train_s),
        )

    def generate_s(self, devices: int) -> float:
        return self.measured.generate_s * (self.measured.devices / devices) ** self.rollout_exponent

    def train_s(self, devices: int) -> float:
        return self.measured.train_s * (self.measured.devices / devices) ** self.train_exponent


@dataclass(frozen=True)
class Schedule:
    """A simulated run: when each step ended, and the policy version each batch came from."""

    step_end_s: tuple[float, ...]
    versions: tuple[int, ...]  # weights version that generated batch s (s - staleness)
    trainer_idle_s: float  # waiting for batches, over the run
    rollout_idle_s: float  # waiting for weights (the staleness bound), over the run

    def step_s(self, warmup: int) -> float:
        """Mean step time after ``warmup`` steps (the steady state)."""
        ends = self.step_end_s
        if len(ends) <= warmup + 1:
            raise ValueError(f"simulate more than {warmup + 1} steps")
        return (ends[-1] - ends[warmup]) / (len(ends) - 1 - warmup)

    def staleness_mean(self, warmup: int) -> float:
        ages = [s - v for s, v in enumerate(self.versions)][warmup:]
        return sum(ages) / len(ages)


def simulate_async(
    generate_s: float,
    train_s: float,
    sync_s: float,
    load_s: float,
    max_staleness: int,
    steps: int = 64,
) -> Schedule:
    """The asynchronous schedule with constant phase times: one rollout loop generating batch
    after batch (batch ``s`` needs weights of version ``>= s - max_staleness``, takes the newest
    that has arrived and loads it first when it is new), one trainer loop training batch after
    batch, each step ending with the broadcast of version ``s + 1``."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    batch_ready: list[float] = []  # when batch s is generated
    ends: list[float] = []  # when trainer step s (its broadcast included) ends
    trainer_idle = 0.0

    def version_ready(v: int) -> float:
        """When weights version v reach the rollout group (0: at the start)."""
        while len(ends) < v:  # trainer steps up to v - 1; their batches exist already
            j = len(ends)
            prev = ends[-1] if ends else 0.0
            nonlocal trainer_idle
            trainer_idle += max(0.0, batch_ready[j] - prev)
            ends.append(max(prev, batch_ready[j]) + train_s + sync_s)
        return ends[v - 1] if v else 0.0

    rollout_free = rollout_idle = 0.0
    loaded = 0
    versions: list[int] = []
    for s in range(steps):
        need = max(0, s - max_staleness)
        start = max(rollout_free, version_ready(need))
        rollout_idle += start - rollout_free
        newest = need
        while newest + 1 <= len(ends) and ends[newest] <= start:
            newest += 1
        if newest != loaded:
            start += load_s
            loaded = newest
        versions.append(newest)
        rollout_free = start + generate_s
        batch_ready.append(rollout_free)
    version_ready(steps)
    return Schedule(tuple(ends), tuple(versions), trainer_idle, rollout_idle)


@dataclass(frozen=True)
class Prediction:
    """Predicted steady-state seconds per step of one way to run."""

    mode: str  # colocated | async
    rollout_devices: int  # 0 for colocated
    trainer_devices: int
    max_staleness: int | None
    step_s: float
    generate_s: float
    train_s: float
    staleness_mean: float = 0.0

    def tokens_per_s(self, tokens: float) -> float:
        return tokens / self.step_s if self.step_s > 0 else 0.0


WARMUP = 8


def predict_colocated(scaling: Scaling, devices: int, switch_s: float) -> Prediction:
    gen, train = scaling.generate_s(devices), scaling.train_s(devices)
    return Prediction("colocated", 0, devices, None, gen + switch_s + train, gen, train)


def predict_async(
    scaling: Scaling,
    rollout_devices: int,
    trainer_devices: int,
    max_staleness: int,
    sync_s: float,
    load_s: float = 0.0,
) -> Prediction:
    """Steady-state step time of ``rollout_devices`` generating and ``trainer_devices``
    training (``sync_s``: the broadcast per step, ``load_s``: loading it into the engines)."""
    if rollout_devices < 1 or trainer_devices < 1:
        raise ValueError("an asynchronous split needs >= 1 rollout and >= 1 trainer device")
    gen, train = scaling.generate_s(rollout_devices), scaling.train_s(trainer_devices)
    schedule = simulate_async(gen, train, sync_s, load_s, max_staleness, steps=WARMUP * 4)
    return Prediction(
        "async",
        rollout_devices,
        trainer_devices,
        max_staleness,
        schedule.step_s(WARMUP),
        gen,
        train,
        schedule.staleness_mean(WARMUP),
    )


def split_table(
    scaling: Scaling,
    devices: int,
    infer_tp: int,
    switch_s: float,
    sync_s: float,
    staleness: Sequence[int] = (0, 1),
    trainer_multiple: int = 1,
    load_s: float = 0.0,
) -> list[Prediction]:
    """Colocated on all ``devices``, then every asynchronous split: ``rollout_ranks`` a multiple
    of ``infer_tp``, the trainers a multiple of ``trainer_multiple`` (tp x pp), per staleness."""
    rows = [predict_colocated(scaling, devices, switch_s)]
    for r in range(infer_tp, devices, infer_tp):
        t = devices - r
        if t % trainer_multiple:
            continue
        rows += [predict_async(scaling, r, t, k, sync_s, load_s) for k in staleness]
    return rows


def best_split(rows: Sequence[Prediction], max_staleness: int) -> Prediction | None:
    """The fastest asynchronous split at ``max_staleness`` (None: there is none)."""
    candidates = [p for p in rows if p.mode == "async" and p.max_staleness == max_staleness]
    return min(candidates, key=lambda p: p.step_s, default=None)


@dataclass(frozen=True)
class PlannedScaling:
    """Phase times from the planner's cost model (:mod:`megarl.plan.cost`) instead of a run:
    generation on ``devices / infer_tp`` vLLM engines, training on ``tp x pp x (devices / (tp
    pp))``; for choosing ``parallel.rollout_ranks`` before anything ran. Memory of the split is
    not modelled: the trainers hold no vLLM engine, the rollout devices nothing else."""

    dims: ModelDims
    workload: Workload
    options: Options
    cluster: Cluster
    numerics: Numerics
    tp: int
    pp: int
    infer_tp: int
    ep: int = 1

    def generate_s(self, devices: int) -> float:
        layout = ParallelLayout(dp=devices, infer_tp=self.infer_tp)
        return rollout_time(self.dims, layout, self.workload, self.cluster)

    def train_s(self, devices: int) -> float:
        layout = ParallelLayout.for_world(devices, self.tp, self.pp, ep=self.ep)
        training = replace(self.workload, rollout=False)
        return step_time(
            self.dims, layout, training, self.options, self.cluster, self.numerics
        ).total

    def weight_transfer_s(self, devices: int) -> float:
        """One full copy of the bf16 weights over the links of ``devices`` ranks: the colocated
        reshard's and the asynchronous broadcast's cost per step, as a first estimate."""
        return 2 * self.dims.num_parameters / (self.cluster.link_gbps(devices) * 1e9)


def format_splits(rows: Sequence[Prediction], source: str) -> str:
    """The split table: colocated first, then each asynchronous split and staleness bound."""
    colocated = rows[0]
    lines = [
        f"colocated vs async ({source}; step seconds, steady state):",
        f"  {'split':<22}{'step s':>10}{'generate s':>12}{'train s':>10}{'vs colocated':>14}"
        f"{'staleness':>11}",
    ]
    for p in rows:
        name = (
            f"colocated {p.trainer_devices}"
            if p.mode == "colocated"
            else f"async {p.rollout_devices}+{p.trainer_devices} k={p.max_staleness}"
        )
        lines.append(
            f"  {name:<22}{p.step_s:>10.2f}{p.generate_s:>12.2f}{p.train_s:>10.2f}"
            f"{colocated.step_s / p.step_s:>13.2f}x{p.staleness_mean:>11.2f}"
        )
    for k in sorted({p.max_staleness for p in rows if p.max_staleness is not None}):
        best = best_split(rows, k)
        if best is not None:
            verdict = "faster" if best.step_s < colocated.step_s else "slower"
            lines.append(
                f"  best at max_staleness={k}: parallel.rollout_ranks={best.rollout_devices} "
                f"({colocated.step_s / best.step_s:.2f}x colocated: {verdict})"
            )
    return "\n".join(lines)
