"""A GRPO run whose actor trains LoRA adapters, at TP2xPP2 on 4 gloo ranks with vLLM at TP2.

One 3-step run serves every check: the rollouts follow the updated adapters (vLLM gets the merged
weights at every reshard; its logprobs equal the trainer's within 1e-4 fp32), the KL loss is
against the frozen base (0 before the first update), a resume from its step-2 checkpoint
continues exactly, and its last checkpoint exports both as a merged Hugging Face model and as a
peft adapter folder that peft loads onto the base model with the same logits (<= 1e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.assets import tiny_char_llama_dir
from tests.e2e.test_train import by_step, copy_checkpoint, launch, metrics, train, workdir

# One xdist worker (make test runs two): one LoRA run (`lora_run`) checked by several tests.
pytestmark = pytest.mark.xdist_group("lora")

__all__ = ["workdir"]  # the module's fixture, shared with the plain training tests

LORA = (
    "actor.lora.rank=8",
    "actor.lora.alpha=16",
    "actor.optim.lr=2e-2",
    "rollout.sampling.temperature=0.7",
    "parallel.tp=2",
    "parallel.pp=2",
    "parallel.infer_tp=2",
)


@pytest.fixture(scope="module")
def lora_run(workdir) -> dict[int, dict]:
    proc = launch(workdir, "lora", "trainer.total_steps=3", "trainer.save_freq=1", *LORA, nproc=4)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return by_step(metrics(workdir, "lora"))


def test_lora_rollouts_follow_the_adapters_and_kl_is_to_the_base(lora_run):
    print(
        {
            s: {k: v for k, v in m.items() if "kl" in k or "logprob_diff" in k}
            for s, m in lora_run.items()
        }
    )
    for step in (1, 2, 3):
        assert lora_run[step]["rollout/logprob_diff_mean"] <= 1e-4, (step, lora_run[step])
    # B starts at zero: the first policy is the base; after updates it has moved away from it,
    # and the rollouts (within 1e-4 of the trainer above) were sampled from the moved policy.
    assert lora_run[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert lora_run[3]["actor/kl_loss"] > 1e-5, lora_run[3]


def test_lora_resume_is_exact(workdir, lora_run):
    # from step 2: step 3 needs the adapters' Adam moments of steps 1 and 2 from the checkpoint
    copy_checkpoint(workdir, "lora", 2, "lora_resumed")
    resumed = by_step(train(workdir, "lora_resumed", "trainer.total_steps=3", *LORA, nproc=4))
    assert sorted(resumed) == [3]
    for step in (3,):
        for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert resumed[step][key] == pytest.approx(lora_run[step][key], abs=1e-6), (step, key)


def _convert(ckpt: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cli = [sys.executable, "-m", "megarl.cli", "convert", "mcore-to-hf"]
    return subprocess.run(
        [*cli, "--ckpt", str(ckpt), "--out", str(out), "--quiet", *extra],
        capture_output=True,
        text=True,
    )


def test_lora_exports_merged_and_as_a_peft_adapter(workdir, lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = workdir / "lora" / "checkpoints" / "step_00000003" / "actor"
    refused = _convert(ckpt, workdir / "no_lora_flag")
    assert refused.returncode == 2 and "--lora merged" in refused.stderr, refused.stderr
    for kind in ("merged", "adapter"):
        proc = _convert(ckpt, workdir / f"export_{kind}", "--lora", kind)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ids = torch.randint(0, 60, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(workdir / "export_merged").eval()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_char_llama_dir()).eval()
        base_logits = base(ids).logits
        peft = PeftModel.from_pretrained(base, workdir / "export_adapter").eval()
        adapted = peft(ids).logits
    assert (merged - base_logits).abs().max() > 1e-3  # the trained adapters are in the export
    assert (adapted - merged).abs().max() <= 1e-5, (adapted - merged).abs().max()


def test_lora_benchmark_smoke(tmp_path):
    """`python -m bench.lora` at its smoke size, 2 rounds: both variants run in each, the second
    round in the reversed order, and each round's ratios and their median are printed and
    stored with every run."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.lora", "--smoke", "--rounds", "2"],
        cwd=root,  # bench/ is a package under the repository root
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, MEGARL_BENCH_RESULTS_DIR=str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RATIO lora/full (median of the rounds): step time" in proc.stdout, proc.stdout
    assert "round 1/2: full, lora" in proc.stdout and "round 2/2: lora, full" in proc.stdout
    figures = json.loads((tmp_path / "lora.smoke.json").read_text())["figures"]
    steps = figures["ratios_by_round"]["step_time"]
    assert len(steps["rounds"]) == 2 and figures["lora_over_full"]["step_time"] == steps["median"]
    assert [sorted(r) for r in figures["rounds_run"]] == [["full", "lora"]] * 2
    assert all(len(r["full"]["load"]) == 2 for r in figures["rounds_run"])
