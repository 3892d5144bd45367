"""Reward models end to end, as a user runs them: `megarl train-rm` at PP2 on the offline synthetic
preference set (accuracy rises; a resumed run equals an uninterrupted one), export to a
Hugging Face sequence classifier that transformers scores identically, then PPO at TP2xPP2 with
that reward model as its only reward."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.assets import tiny_char_llama_dir

# One xdist worker (make test runs two): the trained and exported reward model are shared by
# the tests.
pytestmark = pytest.mark.xdist_group("reward_model")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


def run(
    args: list[str], cwd: Path, timeout: int = 1200, fault: str | None = None, code: int = 0
) -> subprocess.CompletedProcess:
    """``python ARGS`` as a user runs it; ``fault``: a test-only MEGARL_FAULT spec; ``code``: the
    exit status it must end with."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    env.pop("MEGARL_FAULT", None)
    if fault is not None:
        env["MEGARL_FAULT"] = fault
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    assert proc.returncode == code, (args, proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


def metrics(out: Path) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record)
    return steps


def train_rm(
    work: Path, out: str, *overrides: str, fault: str | None = None, code: int = 0, nproc: int = 2
) -> subprocess.CompletedProcess:
    return run(
        [
            "-m",
            "megarl.cli",
            "train-rm",
            str(work / "rm.yaml"),
            f"trainer.output_dir={work / out}",
            *overrides,
            "--nproc-per-node",
            str(nproc),
        ],
        work,
        fault=fault,
        code=code,
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("rm")
    script = str(ROOT / "scripts" / "prepare_preferences.py")
    run(
        [
            script,
            "--out",
            str(work / "prefs"),
            "--source",
            "synthetic-gsm",
            "--easy",
            "--train-size",
            "128",
            "--test-size",
            "32",
            "--max-chars",
            "400",
            "--ascii-only",
        ],
        work,
    )
    config = {
        "model": {"path": str(tiny_char_llama_dir())},
        "data": {
            "train_files": [str(work / "prefs" / "train.parquet")],
            "val_files": [str(work / "prefs" / "test.parquet")],
            "train_batch_size": 16,
            "val_batch_size": 16,
        },
        "parallel": {"pp": 2},  # the pipeline: loss on the last stage, scores broadcast back
        "reward_model": {"micro_batch_size": 8, "max_length": 512, "optim": {"lr": 1e-3}},
        "trainer": {"mlflow_tracking_uri": f"sqlite:///{work / 'mlflow.db'}"},
    }
    (work / "rm.yaml").write_text(yaml.safe_dump(config))
    return work


@pytest.fixture(scope="module")
def trained(work) -> dict[int, dict]:
    train_rm(
        work,
        "full",
        f"trainer.total_steps={STEPS}",
        "trainer.save_freq=4",
        f"trainer.test_freq={STEPS}",
    )
    return metrics(work / "full")


@pytest.fixture(scope="module")
def exported(work, trained) -> Path:
    ckpt = work / "full" / "checkpoints" / f"step_{STEPS:08d}" / "reward"
    out = work / "hf_rm"
    run(
        ["-m", "megarl.cli", "convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out)], work
    )
    return out


def test_accuracy_rises_resume_equals_uninterrupted_and_ctrl_c_saves(work, trained):
    """The resumed run is stopped by a Ctrl-C (SIGINT to `megarl train-rm`) during step 6: like
    `megarl train`, it finishes the step, saves it, exits 130; retention (keep_last=1) then
    leaves only that checkpoint."""
    before, after = trained[0]["val/rm_accuracy"], trained[STEPS]["val/rm_accuracy"]
    assert trained[0]["val/rm_pairs"] == 32
    assert before <= 0.75 and after >= 0.95, (before, after)  # measured: see the closing note
    # resume from a copy of the uninterrupted run's step-4 checkpoint (as if it had stopped there)
    ckpts = work / "resumed" / "checkpoints"
    shutil.copytree(work / "full" / "checkpoints" / "step_00000004", ckpts / "step_00000004")
    (ckpts / "latest").write_text("step_00000004\n")
    proc = train_rm(
        work,
        "resumed",
        f"trainer.total_steps={STEPS}",
        "trainer.save_freq=4",
        "trainer.keep_last=1",
        fault="sigint@step:rank=0:step=6",  # one Ctrl-C: one SIGINT
        code=130,
    )
    assert f"interrupted: stopped after step 6; checkpoint {ckpts / 'step_00000006'}" in proc.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000006"]
    resumed = metrics(work / "resumed")
    assert sorted(resumed) == [5, 6]  # it did resume, and stopped after step 6
    for step in (5, 6):
        for key in ("rm/loss", "rm/accuracy", "rm/grad_norm", "rm/chosen_mean", "rm/gap_mean"):
            assert resumed[step][key] == pytest.approx(trained[step][key], abs=1e-6), (step, key)


def test_a_hung_reward_model_step_is_reported_by_the_watchdog(work):
    """train-rm runs its steps under the same hang watchdog as train: a rank that makes no
    progress for trainer.hang_timeout_s prints where it is and the job stops."""
    proc = train_rm(
        work,
        "rm_hang",
        "parallel.pp=1",
        "trainer.total_steps=2",
        "trainer.hang_timeout_s=15",  # room for a slow phase with two tests at once
        fault="sleep@sync:step=1",
        code=3,
        nproc=1,
    )
    assert "rank 0: no progress for" in proc.stderr, proc.stderr[-3000:]
    assert "megarl: error: rank 0 hung in phase 'sync' of step 1" in proc.stderr


def test_export_scores_equal_in_transformers(work, trained, exported):
    # megarl's own check: the megatron reward model and transformers' scores on a fixed batch
    proc = run(
        [
            "-m",
            "megarl.cli",
            "convert",
            "verify",
            "--hf",
            str(exported),
            "--ckpt",
            str(work / "full" / "checkpoints" / f"step_{STEPS:08d}" / "reward"),
            "--rtol",
            "1e-5",
        ],
        work,
    )
    assert "scores" in proc.stdout, proc.stdout
    # and the validation pairs ranked by transformers alone give the trained accuracy
    import pyarrow.parquet as pq
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from megarl.data import PreferenceDataset

    model = AutoModelForSequenceClassification.from_pretrained(exported, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForSequenceClassification"
    tok = AutoTokenizer.from_pretrained(exported)
    data = PreferenceDataset(
        str(work / "prefs" / "test.parquet"),
        tok,
        batch_size_per_rank=16,
        max_length=512,
        shuffle=False,
        truncation="filter",
    )
    right = total = 0
    with torch.no_grad():
        for items in data:
            for it in items:
                c = model(torch.tensor([it.prompt_ids + it.chosen_ids])).logits[0, 0]
                r = model(torch.tensor([it.prompt_ids + it.rejected_ids])).logits[0, 0]
                right, total = right + int(c > r), total + 1
    assert total == pq.read_metadata(work / "prefs" / "test.parquet").num_rows
    assert right / total == pytest.approx(trained[STEPS]["val/rm_accuracy"], abs=1e-9)


def test_ppo_tp2_pp2_with_the_trained_reward_model(work, exported):
    run(
        [
            str(ROOT / "scripts" / "prepare_gsm8k.py"),
            "--out",
            str(work / "prompts"),
            "--source",
            "gsm-symbolic",
            "--train-size",
            "32",
            "--test-size",
            "8",
        ],
        work,
    )
    config = {
        "model": {"path": str(tiny_char_llama_dir())},
        "data": {
            "train_files": [str(work / "prompts" / "train.parquet")],
            "train_batch_size": 4,
            "max_prompt_length": 1024,
        },
        "parallel": {"tp": 2, "pp": 2, "infer_tp": 2},
        "rollout": {
            "sampling": {"n": 2, "max_response_length": 16},
            "engine": {"kv_cache_gib": 0.125},
        },
        "actor": {"ppo_mini_batch_size": 4, "micro_batch_size": 8, "optim": {"lr": 1e-3}},
        "algorithm": {"adv_estimator": "gae", "use_kl_loss": False, "use_kl_in_reward": True},
        "reward": {"model_path": str(exported), "rule_weight": 0.0},
        "trainer": {
            "total_steps": 2,
            "output_dir": str(work / "ppo"),
            "mlflow_tracking_uri": f"sqlite:///{work / 'mlflow.db'}",
        },
    }
    (work / "ppo.yaml").write_text(yaml.safe_dump(config))
    run(["-m", "megarl.cli", "train", str(work / "ppo.yaml"), "--nproc-per-node", "4"], work)
    steps = metrics(work / "ppo")
    for step in (1, 2):
        m = steps[step]
        assert m["reward/mean"] == pytest.approx(m["reward/model_mean"], abs=1e-6)
        assert "reward/rule_mean" not in m  # rule_weight 0: no rule scorer ran
        for key in ("critic/vf_loss", "critic/values_mean", "actor/pg_loss", "actor/reward_kl"):
            assert key in m and m[key] == m[key], key  # present, not NaN
        assert m["actor/update_ok"] == 1.0 and m["critic/update_ok"] == 1.0
