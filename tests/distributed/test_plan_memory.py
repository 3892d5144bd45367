"""The planner's memory model against measurement, per rank: the total peak within 15%, and each
item the model predicts (activations, the scoring pass's working set, the gradient bucket) and
what stays resident within bounds of its own (ITEM_BOUNDS below).

What is measured: megarl's own CPU training path (fp32 weights, ``build_model`` +
``wrap_for_training``: megatron DDP and the distributed Adam over gloo, a training step through
``run_schedule`` with megarl's vocab-parallel log-prob loss) on 2 gloo ranks, for the real
SmolLM2-135M and a random model of Qwen2.5-0.5B's shape, at several layouts. Each layout runs
two steps, so the second one is steady state (Adam's m and v exist during its forward and
backward, as in every step of a run but the first).

How: the peak bytes of live tensor storage (:mod:`megarl.plan.measure`), tracked from before the
model is built to the end of the second step. RSS would add the interpreter, libraries, allocator
caches and mapped files, which move more than the activations being checked.

Predicted: :func:`megarl.plan.estimate_memory` with the ``CPU_FP32`` numerics (what megarl runs
on CPU) for the rank's pipeline stage, no reserve, no reference, no rollout.

The scoring phase: after the two steps (grads and Adam's state resident, as when the trainer
scores a rollout), the trainer's forward-only scoring pass over a rollout batch of 4 micro-batches
per rank (``megarl.trainer.old_log_probs.score_old_log_probs``: the actor's old logprobs and the
rollout mismatch, in the update's micro-batches: the same count, or for the packed case the token
budget of its pack), every sequence a quarter prompt and three quarters response. Predicted: the
``scoring`` phase of the same workload with the output layer at the response positions.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from megarl.parallel import ParallelLayout
from megarl.plan import CPU_FP32, KNOWN_MODELS, Options, Workload, estimate_memory, resolve_model
from tests.assets import smollm2_dir
from tests.mp import run_gloo

TOLERANCE = 0.15
WORLD = 2
STEPS = 2

# (model, layout, seq, micro-batch, model.recompute kind). On 2 ranks TP1 is DP2 (Adam sharded over DP, the
# whole model with its loss on each rank), PP2 is two stages with a tied embedding split across
# them (here with full recomputation), TP2 splits Qwen2.5-0.5B (14 heads, 2 KV heads) over both;
# SmolLM2's 9 heads allow TP 1 or 3 only. TP2 runs with sequence parallelism (the default at
# tp > 1), in the engine and in the plan. Sequence lengths make activations a real share of
# SmolLM2's peak and keep the 0.5B model fast. The fourth case packs (actor.packing) 4 sequences
# of very unequal lengths (mean 64 of 128): the plan sizes its activations by the mean length.
CASES: list[tuple] = [
    ("smollm2", dict(tp=1), 128, 2, "none"),
    ("smollm2", dict(pp=2), 128, 2, "full"),
    ("qwen2.5-0.5b", dict(tp=2), 32, 1, "selective"),
    ("smollm2", dict(tp=1), 128, 4, "none", (128, 64, 40, 24)),
]


def _packed_lens(case: tuple) -> tuple[int, ...] | None:
    return case[5] if len(case) > 5 else None


def _qwen05_dir(root: Path) -> Path:
    """A config-only folder of Qwen2.5-0.5B's shape: the ranks build it unloaded and fill the
    weights with random values (memory does not depend on them)."""
    out = root / "qwen2.5-0.5b-random"
    out.mkdir(exist_ok=True)
    cfg = {**KNOWN_MODELS["Qwen2.5-0.5B"], "model_type": "qwen2", "hidden_act": "silu"}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def measure_worker(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Peak live tensor bytes of this rank for each case: overall and per phase."""
    from megarl.platform import adapt_megatron_for_cpu

    adapt_megatron_for_cpu()
    return [_measure_case(rank, world, *case) for case in cases]


def _measure_case(rank, world, model_dir, spec, seq, batch, recompute, load, packed=None) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from megarl.algos import vocab_parallel_log_probs
    from megarl.models.build import ModelOptions, build_model
    from megarl.models.distributed import OptimSettings, wrap_for_training
    from megarl.models.forward import run_schedule
    from megarl.parallel import destroy_model_parallel, initialize_model_parallel
    from megarl.plan.measure import live_tensor_tracker

    start, cpu_start = time.perf_counter(), time.process_time()
    layout = ParallelLayout.for_world(world, **spec)
    initialize_model_parallel(layout)
    gc.collect()
    tracker = live_tensor_tracker()
    step = {"n": 0}
    starts: dict[str, int] = {}  # live bytes when each phase began: what it adds is its peak - this

    def begin(name: str) -> None:
        starts[name] = tracker.live
        tracker.phase(name)

    with tracker:
        begin("setup")
        model, dims = build_model(
            model_dir, layout, "actor", ModelOptions(recompute=recompute), load=load
        )
        if not load:
            gen = torch.Generator().manual_seed(rank)
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0.0, 0.02, generator=gen)
        ddp, optimizer, _ = wrap_for_training(model, OptimSettings())
        config = ddp.config
        finalize = config.finalize_model_grads_func

        def finalize_tracked(*args, **kwargs):
            begin(f"grad-sync{step['n']}")
            return finalize(*args, **kwargs)

        config.finalize_model_grads_func = finalize_tracked
        tp_group = ps.get_tensor_model_parallel_group() if layout.tp > 1 else None
        gen = torch.Generator().manual_seed(100 + ps.get_data_parallel_rank())
        ids = torch.randint(0, dims.vocab_size, (batch, seq), generator=gen)

        def loss_fn(logits, mb):
            logp = vocab_parallel_log_probs(
                logits[:, :-1], mb["input_ids"][:, 1:], tp_group, vocab_size=dims.vocab_size
            )
            return -logp.mean(), {}

        for n in range(STEPS):
            step["n"] = n
            begin(f"forward-backward{n}")
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            micro_batch = {"input_ids": ids}
            if packed is not None:  # one pack of the rows' first packed[i] tokens
                micro_batch["seq_lens"] = torch.tensor(packed)
            run_schedule([ddp], [micro_batch], loss_fn, forward_only=False)
            begin(f"optimizer-step{n}")
            optimizer.step()
        tracker.phase(None)
        config.finalize_model_grads_func = finalize
        scoring = _score(tracker, ddp, dims, seq, batch, packed, gen)
        del ddp, optimizer, model, config
    gc.collect()
    stage = ps.get_pipeline_model_parallel_rank()
    destroy_model_parallel()
    return {
        "peak": tracker.peak,
        "phases": dict(tracker.phases),
        "starts": starts,
        "scoring": scoring,
        "stage": stage,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
    }


def _scoring_shape(seq: int, batch: int, packed) -> tuple[int, int, int | None, int]:
    """(sequence length, prompt length, token budget or None, sequences per rank) of the scoring
    measurement: the update's micro-batching, 4 micro-batches per rank."""
    if packed is None:
        return seq, seq // 4, None, 4 * batch
    length = sum(packed) // len(packed)  # the pack's mean length: len(packed) per budget
    return length, length // 4, sum(packed), 4 * len(packed)


def _score(tracker, ddp, dims, seq, batch, packed, gen) -> dict[str, int]:
    """Peak and resident bytes of the trainer's scoring pass over this rank's rollout batch."""
    import torch

    from megarl.trainer.batch import Samples
    from megarl.trainer.model_ops import MicroBatching
    from megarl.trainer.old_log_probs import score_old_log_probs

    length, prompt, budget, n = _scoring_shape(seq, batch, packed)
    ids = torch.randint(0, dims.vocab_size, (n, length), generator=gen).tolist()
    samples = Samples.from_sequences(
        [r[:prompt] for r in ids], [r[prompt:] for r in ids], list(range(n)), 0, "cpu"
    )
    samples.tensors.rollout_log_prob = torch.zeros_like(samples.response_mask)
    batching = MicroBatching(size=batch, max_tokens=budget, packing=packed is not None)
    resident = tracker.live
    tracker.phase("scoring")
    score_old_log_probs(ddp, samples, dims.vocab_size, 1.0, batching, dims.is_moe)
    tracker.phase(None)
    return {"peak": tracker.phases["scoring"], "resident": resident}


def _predict(model_dir: str, spec: dict, seq: int, batch: int, recompute: str, packed=None):
    _, dims = resolve_model(model_dir)
    layout = ParallelLayout.for_world(WORLD, **spec)
    workload = Workload(
        seq_len=seq,
        micro_batch=batch,
        global_batch=batch * layout.dp,  # one micro-batch per rank, as measured
        reference=False,
        rollout=False,
        mean_seq_len=sum(packed) // len(packed) if packed else None,
    )
    options = Options(recompute=recompute, packing=packed is not None)
    length, prompt, budget, n = _scoring_shape(seq, batch, packed)
    scoring = replace(
        workload,
        seq_len=length,
        response_len=length - prompt,
        mean_seq_len=None,
        output_positions=length - prompt,
        micro_batch_tokens=budget,
        rollout_batch=n * layout.dp,
        reference=False,
    )
    return (
        layout,
        estimate_memory(dims, layout, workload, CPU_FP32, options, reserve=0),
        estimate_memory(dims, layout, scoring, CPU_FP32, options, reserve=0),
    )


# Each item of the plan bounded on its own, (lowest, highest) relative error of the planned bytes
# against the measured ones. The total peak's 15% leaves room for an activation model that is off
# by half (weights and optimizer state are 72-93% of the peaks), so the items that the model
# predicts rather than counts are checked one by one. Measured (bench/results/plan_memory.json;
# the bytes are the same every run): resident -0.1%..0.0%; activations -2.7%..+13.8% (the +13.8%
# is the PP2 last stage); the scoring pass's working set +0.5%..+40.3% (+40% on the PP2 first
# stage, 14.5 vs 10.3 MiB; +34% packed: the plan sizes it by the budget's padded rows); the
# gloo gradient bucket 0.0% where DP > 1. The bounds leave some 7 points beyond the measured
# range on the side it was measured on, 10 on the other: a halved or doubled activation model,
# or a resident item counted twice, fails.
ITEM_BOUNDS = {
    "resident": (-0.01, 0.01),
    "activations": (-0.10, 0.20),
    "scoring working set": (-0.10, 0.50),
    "grad-sync transient": (-0.05, 0.05),
}
# Not bounded, with why (the rows still record them): at DP1 (the PP2 and TP2 cases) the plan
# counts a gradient bucket for a grad-sync that moves nothing (planned 203 and 942 MiB, measured
# 0); the optimizer step's 2 x shard x 4 bytes of torch Adam temporaries (216-519 MiB) are never
# seen: its update runs in place. Neither is the peak phase of any case.


def item_rows(case: tuple, model_dir: str, measured: dict) -> list[dict]:
    """Planned vs measured bytes of each item of the step-2 phases and the scoring pass, for one
    rank: what stays resident (weights, grads, optimizer state) and what each phase adds to it
    (its activations or transient buffers: the phase's peak minus the live bytes it began with)."""
    _, spec, seq, batch, rc, *_ = case
    layout, estimate, scored = _predict(model_dir, spec, seq, batch, rc, _packed_lens(case))
    plan = estimate.stages[measured["stage"]].phase_items
    scoring = scored.stages[measured["stage"]].phase_items["scoring"]
    last = STEPS - 1

    def added(phase: str) -> int:
        return measured["phases"][f"{phase}{last}"] - measured["starts"][f"{phase}{last}"]

    fb = plan["forward-backward"]
    items = {
        "resident": (
            sum(v for k, v in fb.items() if k != "activations"),
            measured["starts"][f"forward-backward{last}"],
        ),
        "activations": (fb["activations"], added("forward-backward")),
        "scoring working set": (
            scoring["activations"] + scoring["scores"],
            measured["scoring"]["peak"] - measured["scoring"]["resident"],
        ),
        "grad-sync transient": (plan["grad-sync"]["transient"], added("grad-sync")),
        "optimizer-step transient": (
            plan["optimizer-step"]["transient"],
            added("optimizer-step"),
        ),
    }
    if layout.dp == 1:  # no gradient to reduce: not bounded (see ITEM_BOUNDS)
        items["grad-sync transient (DP1)"] = items.pop("grad-sync transient")
    return [
        {
            "item": item,
            "planned": planned,
            "measured": got,
            "error": (planned - got) / got if got else None,
        }
        for item, (planned, got) in items.items()
    ]


def write_rows(rows: list[dict], folder: Path) -> Path:
    """The measured rows as ``plan_memory.json`` in FOLDER, with the commit and package versions
    (bench/results_io.py's), for docs to cite."""
    from bench.results_io import git_commit, versions

    path = folder / "plan_memory.json"
    record = {"bench": "plan_memory", "git": git_commit(), "versions": versions(), "rows": rows}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


@pytest.mark.timeout(300)
def test_predicted_memory_per_rank_and_per_item(tmp_path):
    """Per rank and case: the total peak, the step-2 forward-backward and the scoring pass within
    15% (TOLERANCE), and each item within its ITEM_BOUNDS (~70 s: one launch of 2 ranks). The
    rows (planned and measured bytes per item, per case and rank) go to plan_memory.json in
    $MEGARL_BENCH_RESULTS_DIR when set (bench/results/ holds the stored ones), else in the
    test's temporary folder."""
    dirs = {"smollm2": str(smollm2_dir()), "qwen2.5-0.5b": str(_qwen05_dir(tmp_path))}
    cases: list[tuple] = [
        (dirs[c[0]], *c[1:5], c[0] != "qwen2.5-0.5b", _packed_lens(c)) for c in CASES
    ]
    measured = run_gloo(measure_worker, WORLD, cases)
    mib = 1 << 20
    rows, failures, stored = [], [], []
    for i, (name, spec, seq, batch, rc, *_) in enumerate(CASES):
        packed = _packed_lens(CASES[i])
        layout, estimate, scored = _predict(cases[i][0], spec, seq, batch, rc, packed)
        for rank in range(WORLD):
            m = measured[rank][i]
            stage = estimate.stages[m["stage"]]
            sc_pred = scored.stages[m["stage"]].phases["scoring"]
            sc_meas = m["scoring"]["peak"]
            sc_err = (sc_pred - sc_meas) / sc_meas
            fb_meas = m["phases"][f"forward-backward{STEPS - 1}"]
            fb_pred = stage.phases["forward-backward"]
            err = (stage.peak - m["peak"]) / m["peak"]
            fb_err = (fb_pred - fb_meas) / fb_meas
            label = f"{name} {layout}{'' if rc == 'none' else f' {rc} recompute'} s{seq} b{batch} rank {rank}"
            if packed:
                label += f" packed {list(packed)}"
            rows.append(
                f"{label}: peak predicted {stage.peak / mib:.0f} MiB ({stage.phase}), measured "
                f"{m['peak'] / mib:.0f} MiB ({err:+.1%}); forward-backward {fb_pred / mib:.0f} vs "
                f"{fb_meas / mib:.0f} MiB ({fb_err:+.1%}); scoring {sc_pred / mib:.0f} vs "
                f"{sc_meas / mib:.0f} MiB ({sc_err:+.1%}); {m['seconds']:.1f} s, cpu "
                f"{m['cpu_seconds']:.1f} s"
            )
            if abs(err) > TOLERANCE or abs(fb_err) > TOLERANCE or abs(sc_err) > TOLERANCE:
                failures.append(rows[-1])
            totals = [
                ("peak", stage.peak, m["peak"]),
                ("forward-backward", fb_pred, fb_meas),
                ("scoring", sc_pred, sc_meas),
            ]
            items = [
                {"item": k, "planned": p, "measured": g, "error": (p - g) / g} for k, p, g in totals
            ] + item_rows(CASES[i], cases[i][0], m)
            for r in items:
                stored.append({"case": label, **r})
                if r["item"] not in ITEM_BOUNDS:
                    continue
                low, high = ITEM_BOUNDS[r["item"]]
                error = math.inf if r["error"] is None else r["error"]  # None: measured 0
                if not low <= error <= high:
                    failures.append(
                        f"{label}: {r['item']} planned {r['planned'] / mib:.2f} MiB, measured "
                        f"{r['measured'] / mib:.2f} MiB ({error:+.1%}, bounds {low:+.0%} "
                        f"to {high:+.0%})"
                    )
            rows.append(
                "    "
                + "; ".join(
                    f"{r['item']} {r['planned'] / mib:.1f} vs {r['measured'] / mib:.1f} MiB"
                    + ("" if r["error"] is None else f" ({r['error']:+.1%})")
                    for r in items[len(totals) :]
                )
            )
    folder = Path(os.environ.get("MEGARL_BENCH_RESULTS_DIR") or tmp_path)
    print("\n".join(rows), "\nrows stored in", write_rows(stored, folder))
    assert not failures, "\n".join(failures)
