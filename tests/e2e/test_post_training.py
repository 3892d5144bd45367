"""The post-training chain as users run it: configs/chain_{sft,dpo,grpo}_cpu.yaml through the
command line (at test sizes), on the toy task the quickstart prepares (`python -m
megarl.quickstart --recipe chain`): GSM-Symbolic prompts, the tiny character-level Llama.

- `megarl train-sft`: the chat-format SFT run learns (loss and validation loss fall, token
  accuracy rises); its checkpoint exports with `megarl convert mcore-to-hf` to a folder whose
  validation NLL under transformers equals the run's last val/sft_loss.
- On-policy distillation: GRPO from the random model with that export as the teacher against
  GRPO alone, same seeds and steps (the budget and figures are in the test's docstring).

`megarl train-dpo` with configs/chain_dpo_cpu.yaml, its learning on held-out pairs and the
resume of both trainers at another layout run in tests/distributed/test_post_training_parity.py
(one launch of 4 ranks for all of it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.tools.quickstart import prepare

# One xdist worker (make test runs two): the SFT and teacher runs are shared by the tests.
pytestmark = pytest.mark.xdist_group("post_training")

ROOT = Path(__file__).resolve().parents[2]
SFT_STEPS, RL_STEPS = 12, 6
QUIET = ("trainer.loggers=[console]", "trainer.mlflow_tracking_uri=none")


def run(args: list[str], cwd: Path, timeout: int = 1200) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


def metrics(out: Path) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record)
    return steps


def megarl(work: Path, verb: str, config: str, *overrides: str, nproc: int = 1) -> None:
    run(
        [
            "-m",
            "megarl.cli",
            verb,
            str(ROOT / "configs" / config),
            *QUIET,
            *overrides,
            "--nproc-per-node",
            str(nproc),
        ],
        work,
    )


def export(work: Path, run_dir: str, out: str) -> Path:
    step = (work / run_dir / "checkpoints" / "latest").read_text().strip()
    ckpt = work / run_dir / "checkpoints" / step / "actor"
    run(
        [
            "-m",
            "megarl.cli",
            "convert",
            "mcore-to-hf",
            "--ckpt",
            str(ckpt),
            "--out",
            str(work / out),
        ],
        work,
    )
    return work / out


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The chain recipe's folder as the configs name it (outputs/chain), relative to the runs'
    working directory."""
    work = tmp_path_factory.mktemp("chain")
    prepare(work / "outputs" / "chain", "chain", train_size=128, test_size=16)
    return work


@pytest.fixture(scope="module")
def sft(work) -> dict[int, dict]:
    megarl(
        work,
        "train-sft",
        "chain_sft_cpu.yaml",
        f"trainer.total_steps={SFT_STEPS}",
        f"trainer.test_freq={SFT_STEPS // 2}",
        "trainer.save_freq=0",
    )
    return metrics(work / "outputs" / "chain" / "sft_run")


@pytest.fixture(scope="module")
def teacher(work, sft) -> Path:
    return export(work, "outputs/chain/sft_run", "outputs/chain/sft_model")


def test_sft_learns_the_chat_format_task(sft):
    first, last = sft[1], sft[SFT_STEPS]
    assert last["sft/loss"] < 0.6 * first["sft/loss"], (first["sft/loss"], last["sft/loss"])
    assert sft[SFT_STEPS]["val/sft_loss"] < 0.6 * sft[0]["val/sft_loss"]
    assert sft[SFT_STEPS]["val/sft_token_accuracy"] > sft[0]["val/sft_token_accuracy"] + 0.1
    assert sft[0]["val/sft_rows"] == 16  # every validation row, once
    assert all(sft[s]["sft/update_ok"] == 1.0 for s in range(1, SFT_STEPS + 1))


def test_the_exported_sft_model_scores_the_validation_set_as_the_run_did(work, sft, teacher):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.data import SFTDataset

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(teacher)
    data = SFTDataset(
        str(work / "outputs" / "chain" / "sft" / "test.parquet"),
        tok,
        batch_size_per_rank=16,
        max_length=1024,
        shuffle=False,
        drop_last=False,
    )
    nll = tokens = 0.0
    with torch.no_grad():
        for items in data:
            for it in items:
                ids = torch.tensor([it.prompt_ids + it.response_ids])
                logp = torch.log_softmax(model(ids).logits[0, :-1], -1)
                picked = logp.gather(-1, ids[0, 1:].unsqueeze(-1))[:, 0][len(it.prompt_ids) - 1 :]
                mask = torch.tensor(it.loss_mask, dtype=torch.float32)
                nll -= float((picked * mask).sum())
                tokens += float(mask.sum())
    assert nll / tokens == pytest.approx(sft[SFT_STEPS]["val/sft_loss"], rel=1e-5)


def test_distillation_from_the_sft_teacher_gives_grpo_a_head_start(work, teacher):
    """GRPO from the random tiny model on the vowel reward, RL_STEPS (6) steps of 8 prompts x 4
    samples x 32 tokens, lr 1e-2 (configs/chain_grpo_cpu.yaml at those sizes), with and without
    the SFT model as a teacher (the config's mode reward, coef 1.0). The per-step figures are
    printed (pytest -s); docs/post_training.md quotes measured runs at three seeds.

    The claim is the teacher's head start: over steps 2-4 (step 1's rollout is the same in both
    runs) the mean reward with the teacher is higher. Later steps are not compared: on this toy
    reward (the share of vowels) GRPO alone can go past the teacher's own level (seed 3 reached
    0.99 at step 6) while distillation holds the student near the teacher (0.72-0.85)."""
    common = (
        f"model.path={work / 'outputs' / 'chain' / 'model'}",
        f"trainer.total_steps={RL_STEPS}",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        "actor.optim.lr=1e-2",
    )
    megarl(work, "train", "chain_grpo_cpu.yaml", *common, "trainer.output_dir=outputs/distill")
    megarl(
        work,
        "train",
        "chain_grpo_cpu.yaml",
        *common,
        "algorithm.distill.teacher_path=null",
        "trainer.output_dir=outputs/grpo",
    )
    distill, grpo = metrics(work / "outputs" / "distill"), metrics(work / "outputs" / "grpo")
    steps = range(1, RL_STEPS + 1)
    kl = [distill[s]["distill/reverse_kl"] for s in steps]
    assert sum(kl[-3:]) / 3 < 0.5 * sum(kl[:3]) / 3, kl
    assert "distill/reverse_kl" not in grpo[1]
    with_teacher = [distill[s]["reward/mean"] for s in steps]
    alone = [grpo[s]["reward/mean"] for s in steps]
    assert with_teacher[0] == pytest.approx(alone[0], abs=1e-6)  # the same first rollout
    print(f"distill/reverse_kl {kl}\nreward/mean with the teacher {with_teacher}\nalone {alone}")
    head_start = sum(with_teacher[1:4]) / 3 - sum(alone[1:4]) / 3  # steps 2-4
    # measured at trainer.seed 1, 2, 3: +0.084, +0.168, +0.050
    assert head_start > 0.03, (with_teacher, alone)
