"""The Slurm launcher under the elastic supervisor, against stand-ins for srun and scontrol
(tests/fake_slurm: local processes, srun's variables and its failure lines). What real Slurm
does with the step (placement, GPU binding) is not covered here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megarl.cluster.elastic import Supervisor
from megarl.cluster.slurm import SlurmLauncher, _first_failure
from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.parallel import ParallelLayout
from tests.assets import tiny_char_llama_dir

FAKE = Path(__file__).resolve().parents[1] / "fake_slurm"
ROOT = FAKE.parents[1]


def test_srun_failure_lines():
    assert _first_failure("srun: error: node3: task 5: Killed") == (
        "node3",
        5,
        "ended on node3 (Killed)",
    )
    assert _first_failure("srun: error: gpu-07: tasks 8-15: Exited with exit code 1") == (
        "gpu-07",
        8,
        "exited with code 1 on gpu-07",
    )
    node, rank, how = _first_failure("srun: error: Node failure on gpu-02")
    assert (node, rank) == ("gpu-02", None) and "node failure" in how
    assert _first_failure("srun: Terminating StepId=12.0") is None


def test_outside_an_allocation_or_under_srun_is_refused(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigError, match="inside a Slurm allocation"):
        SlurmLauncher(None, 8)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    with pytest.raises(ConfigError, match="not under srun"):
        SlurmLauncher(None, 8)


def test_a_lost_rank_restarts_the_step_without_its_node(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{FAKE}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1,n2")
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.setenv("FAKE_SRUN_LOG", str(tmp_path / "srun.jsonl"))
    monkeypatch.setenv("FAKE_RANK_LOG", str(tmp_path / "ranks.jsonl"))
    monkeypatch.chdir(ROOT)
    cfg = load_config(
        None,
        [
            f"model.path={tiny_char_llama_dir()}",
            "data.train_files=[unused.parquet]",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "parallel.tp=2",
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.elastic.max_restarts=1",
        ],
    )
    launcher = SlurmLauncher(None, 2)
    assert launcher.nodes == ["n1", "n2"] and launcher.capacity([]) == 4
    assert not launcher.placeable(3, [])  # whole nodes only, beyond one node
    sup = Supervisor(cfg, ["run.yaml"], ParallelLayout(tp=2, dp=2), launcher)
    assert sup.run(module="tests.fake_slurm.rank") == 0
    steps = [json.loads(x) for x in (tmp_path / "srun.jsonl").read_text().splitlines()]
    assert [(s["opts"]["nodelist"], s["opts"]["ntasks"], s["master"]) for s in steps] == [
        ("n1,n2", "4", "n1"),
        ("n1", "2", "n1"),  # n2, where rank 3 died, is left out
    ]
    assert steps[1]["opts"]["kill-on-bad-exit"] == "1"
    ranks = [json.loads(x) for x in (tmp_path / "ranks.jsonl").read_text().splitlines()]
    second = sorted((r["SLURM_PROCID"], r["SLURMD_NODENAME"]) for r in ranks if r["restarts"])
    assert second == [("0", "n1"), ("1", "n1")]
    assert "parallel.tp=2" in ranks[-1]["args"] and ranks[-1]["args"][0] == "run.yaml"
    [event] = [json.loads(x) for x in (tmp_path / "run" / "elastic.jsonl").read_text().splitlines()]
    assert event["why"] == "rank 3 ended on n2 (Killed)" and event["new_world_size"] == 2
