"""A new user's bad inputs, as `megarl train` and `megarl convert` meet them: an earlier run in the
output folder, a reward that returns NaN for every sample, a parquet without the reward column,
verl's spellings, and a checkpoint from someone else with broken weights and metadata that
carries a pickle payload.

One launch (the NaN reward, started with trainer.overwrite=true over an earlier run, with verl's
command-line habits); everything else is refused before any process starts. The damaged
checkpoint, Ctrl-C and metric de-duplication are in test_train.py, where they reuse its 4-step run.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

import megarl.checkpoint.manifest as manifest
from megarl.cli import main as cli_main
from megarl.run import trainer_state
from megarl.tools.testing.assets import tiny_char_llama_dir
from tests.e2e.test_train import make_workdir, megarl_command

ROOT = Path(__file__).resolve().parents[2]

NAN_SCORER = "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = make_workdir(tmp_path_factory.mktemp("reliability"))
    (work / "nan_scorer.py").write_text(NAN_SCORER)
    return work


def earlier_run(folder: Path) -> None:
    """What an earlier run leaves: metrics and a checkpoint (only its folder matters here)."""
    (folder / "checkpoints" / "step_00000001").mkdir(parents=True)
    (folder / "checkpoints" / "latest").write_text("step_00000001\n")
    (folder / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.25}\n')


def test_nan_reward_stops_the_run_and_overwrite_moves_the_earlier_run_aside(work, capsys):
    """resume=never over an earlier run is refused before launch; trainer.overwrite=true moves it
    aside and starts afresh, with the options in the middle of the command line and a single path
    for data.train_files (verl's habits). The scorer returns NaN for every sample: the first step
    stops, every rank at once, with the scorer, its error and a sample (exit 2, the error the last
    line, no traceback)."""
    out = work / "nan"
    earlier_run(out)
    run = str(work / "run.yaml")
    assert cli_main(["train", run, f"trainer.output_dir={out}", "trainer.resume=never"]) == 2
    err = capsys.readouterr().err
    assert f"trainer.output_dir={out} holds an earlier run" in err
    assert "trainer.resume=auto" in err and "trainer.overwrite=true" in err

    proc = megarl_command(
        work,
        "train",
        run,
        f"trainer.output_dir={out}",
        "--nproc-per-node",
        "1",
        f"data.train_files={work / 'data' / 'train.parquet'}",  # no brackets
        "trainer.overwrite=true",
        f"reward.custom_fn={work / 'nan_scorer.py'}:score",
    )
    text = proc.stdout
    assert proc.returncode == 2, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("megarl: error: 16 of 16 samples (100%) failed to score"), last
    assert "reward.max_failed_fraction=0.5" in last
    assert f"scorer: reward.custom_fn={work / 'nan_scorer.py'}:score" in last
    assert "ValueError: scorer returned nan" in last
    # the response as Python's repr shows it: in double quotes when it holds a single quote (a
    # sampled character), else in single quotes
    shown = re.search(
        r"on the sample with data_source 'openai/gsm8k', response (['\"]).*\1, ", last
    )
    assert shown, last
    assert "ground truth '" in last
    assert "Traceback" not in text and "ChildFailedError" not in text
    assert "[####" not in text  # no step was trained or logged
    [aside] = work.glob("nan.old-*")
    assert f"moved the earlier run in {out} to {aside}" in text
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1, "reward/mean": 0.25}\n'
    assert (aside / "checkpoints" / "step_00000001").is_dir()
    assert not (out / "checkpoints" / "latest").exists()


def test_missing_reward_column_and_verl_spellings_are_refused_before_launch(work, capsys):
    run = str(work / "run.yaml")
    table = pq.read_table(work / "data" / "train.parquet").drop(["reward_model"])
    pq.write_table(table, work / "no_reward_model.parquet")
    code = cli_main(
        [
            "train",
            run,
            f"data.train_files={work / 'no_reward_model.parquet'}",
            "reward.custom_fn=null",  # the built-in gsm8k scorer, which needs the ground truth
            f"trainer.output_dir={work / 'unused'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "no_reward_model.parquet: missing column 'reward_model'" in err
    assert "reward.custom_fn" in err and "require_ground_truth" not in err

    verl = [
        "train",
        run,
        "--nproc-per-node",
        "1",
        "trainer.total_training_steps=10",
        f"custom_reward_function.path={work / 'nan_scorer.py'}",
        "data.max_response_length=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    ]
    assert cli_main(verl) == 2
    err = capsys.readouterr().err
    for verl_key, megarl_key in (
        ("trainer.total_training_steps", "trainer.total_steps"),
        ("custom_reward_function.path", "reward.custom_fn"),
        ("data.max_response_length", "rollout.sampling.max_response_length"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", "actor.ppo_mini_batch_size"),
    ):
        assert f"'{verl_key}' is verl's name; did you mean {megarl_key}" in err, (verl_key, err)
    assert "unrecognized" not in err


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_whose_metadata_runs_code_is_refused_by_resume_and_convert(work, capsys):
    """A training checkpoint from someone else, with broken weights (3 NaN and 1 inf in one
    tensor, its manifest intact): `megarl convert mcore-to-hf` refuses to export it naming the
    tensor (exit 2, nothing written). Then its actor's dist-checkpoint `.metadata` is replaced by
    a pickle that runs `os.system` when unpickled, and its manifest updated to match (so the
    checksums pass). Resume (`megarl train`, before launch) and `megarl convert mcore-to-hf`
    refuse it naming the file; the payload never runs."""
    out = work / "foreign"
    step = out / "checkpoints" / "step_00000002"
    hf = work / "broken_hf"
    shutil.copytree(tiny_char_llama_dir(), hf)
    [weights] = hf.glob("*.safetensors")
    tensors = load_file(weights)
    broken = "model.layers.0.mlp.down_proj.weight"
    tensors[broken][0, :3] = float("nan")
    tensors[broken][1, 0] = float("inf")
    save_file(tensors, weights, metadata={"format": "pt"})
    subprocess.run(
        [sys.executable, "-m", "checkpoints_tools", "hf-to-mcore", "--hf", str(hf),
         "--out", str(step / "actor")],
        check=True, capture_output=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    export = ["--ckpt", str(step / "actor"), "--out", str(work / "broken_export"), "--quiet"]
    assert cli_main(["convert", "mcore-to-hf", *export]) == 2
    err = capsys.readouterr().err
    assert f"tensor {broken} holds 3 NaN and 1 inf values" in err and "nothing was exported" in err
    assert not (work / "broken_export").exists()
    (step / "trainer").mkdir()
    state = trainer_state.write(step / "trainer", {"step": 2, "roles": ["actor"], "history": []})
    manifest.write(step, [manifest.record(step, state.relative_to(step).as_posix())])
    (out / "checkpoints" / "latest").write_text("step_00000002\n")
    marker = work / "payload-ran"
    meta = step / "actor" / "mcore" / ".metadata"
    meta.write_bytes(pickle.dumps(Payload(marker)))
    records = manifest.read(step / "actor")
    records["mcore/.metadata"] = manifest.record(step / "actor", "mcore/.metadata")
    manifest.write(step / "actor", records.values())

    assert cli_main(["train", str(work / "run.yaml"), f"trainer.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert f"{meta} is not plain checkpoint metadata: it names posix.system" in err, err
    assert "starting 1 rank" not in err  # refused before launch
    ckpt = ["--ckpt", str(out / "checkpoints"), "--out", str(work / "foreign_hf"), "--quiet"]
    assert cli_main(["convert", "mcore-to-hf", *ckpt]) == 2
    err = capsys.readouterr().err
    assert f"{meta} is not plain checkpoint metadata" in err and "Traceback" not in err
    assert not marker.exists()
    assert not (work / "foreign_hf").exists()
    assert json.loads((step / "actor" / "megarl_checkpoint.json").read_text())["role"] == "actor"
