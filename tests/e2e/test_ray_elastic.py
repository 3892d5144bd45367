"""The Ray launcher and elastic recovery, as a user runs them: `megarl train ... --launcher ray`
against a Ray head started here (`ray start --head`, 4 CPUs: 4 one-CPU ranks), and jobs that lose
a rank and restart by themselves on the ranks left.

The tiny random Llama, GSM-Symbolic prompts and the toy vowel reward of tests/e2e/test_train.py.
The Ray launcher's parity with torchrun at TP2 x PP2 and its SIGTERM handling are checked beside
the torchrun run they compare with, in test_train.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.cli import main as cli_main
from megarl.ports import free_port
from tests.e2e.test_train import by_step, launch, make_workdir, metrics

# One xdist worker (make test runs two): one Ray head for the module; Ray clusters on one
# machine run one at a time.
pytestmark = pytest.mark.xdist_group("ray")

RAY = Path(sys.executable).with_name("ray")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return make_workdir(tmp_path_factory.mktemp("ray_elastic"))


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head on this machine, as `ray start --head` makes one, with 4 CPUs (4 ranks of one
    CPU each) and a small object store; stopped (with every process it started) at the end."""
    port = free_port()
    temp = tmp_path_factory.mktemp("ray")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    head = subprocess.Popen(
        [
            str(RAY),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=4",
            "--object-store-memory=80000000",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the head answers once its GCS is up
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.5)
    yield address
    head.terminate()  # `ray start --block` stops the head's processes on SIGTERM
    head.wait(timeout=60)


QUIET = "trainer.loggers=[console]"  # metrics.jsonl and the console: no tracker start-up


def ray_job(address: str) -> tuple[str, ...]:
    return ("--launcher", "ray", "--address", address)


def records(work: Path, out: str) -> list[dict]:
    return metrics(work, out)


def test_bad_launches_are_refused_before_any_rank_starts(workdir, ray_head, monkeypatch, capsys):
    run = str(workdir / "run.yaml")
    base = ["train", run, f"trainer.output_dir={workdir / 'refused'}"]
    # no Ray installed: the extra is named
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "ray", None)
        assert cli_main([*base, "--launcher", "ray", "--nproc-per-node", "1"]) == 2
    assert "pip install 'megarl[ray]'" in capsys.readouterr().err
    # an address where nothing listens: refused at once
    closed = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    assert cli_main([*base, "--launcher", "ray", "--address", closed]) == 2
    assert f"no Ray cluster answers at {closed}" in capsys.readouterr().err
    assert time.monotonic() - t0 < 30
    # a dashboard address (for `ray job submit`) is not a head's address
    assert cli_main([*base, "--launcher", "ray", "--address", "http://127.0.0.1:8265"]) == 2
    assert "is the address of Ray's dashboard" in capsys.readouterr().err
    # a min_world_size no layout takes (4 ranks at TP2: 3 ranks take neither TP2 nor the batch)
    elastic = [
        "trainer.elastic.max_restarts=1",
        "trainer.elastic.min_world_size=3",
        "parallel.tp=2",
    ]
    assert cli_main([*base, *elastic, "--nproc-per-node", "4"]) == 2
    err = capsys.readouterr().err
    assert "trainer.elastic.min_world_size=3: no layout" in err and "[1, 2, 4]" in err
    # more ranks than the cluster holds; and a port that accepts but never answers as a Ray
    # head, refused within a bounded time (the connect timeout lowered to 3 s for that case
    # only: the real head keeps the default, as connecting to it took over 3 s on a loaded CI)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    silent = f"127.0.0.1:{listener.getsockname()[1]}"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    batch8 = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]  # 8 DP ranks split it
    for address, nproc, connect_s, message in (
        (ray_head, 8, 30.0, "cannot hold 8 ranks (one CPU each): its largest node has 4 CPUs"),
        (silent, 1, 3.0, f"the Ray cluster at {silent} did not answer within 3 s"),
    ):
        script = (
            f"import sys, megarl.cluster.ray_job as r; r.CONNECT_TIMEOUT_S = {connect_s}; "
            "from megarl.cli import main; raise SystemExit(main(sys.argv[1:]))"
        )
        t0 = time.monotonic()
        launcher = ["--launcher", "ray", "--address", address, "--nproc-per-node", str(nproc)]
        proc = subprocess.run(
            [sys.executable, "-c", script, *base, *batch8, *launcher],
            capture_output=True,
            text=True,
            env=env,
            cwd=workdir,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert message in proc.stderr, proc.stderr[-2000:]
        print(address, f"refused in {time.monotonic() - t0:.1f} s")
    listener.close()
    assert not (workdir / "refused" / "metrics.jsonl").exists()


def test_a_ranks_user_error_ends_the_ray_job_with_its_message_and_code_2(workdir, ray_head):
    # A wrong import path is refused before launch now; a full disk at the step-1 save is found
    # only by the rank (test-only fault point): a megarl error there, exit 2.
    one = "trainer.total_steps=1"
    fault = "enospc@save:step=1"
    proc = launch(workdir, "ray_bad", one, QUIET, *ray_job(ray_head), nproc=1, fault=fault)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("megarl: error: saving the checkpoint of step 1"), lines
    assert "Traceback" not in proc.stderr and "RayActorError" not in proc.stderr


ELASTIC = (
    QUIET,
    "parallel.tp=2",
    "trainer.total_steps=4",
    "trainer.save_freq=2",
    "trainer.elastic.max_restarts=1",
    "trainer.elastic.wait_s=1",
)
KILL_AFTER_STEP_3 = "kill@step:rank=3:step=4"  # rank 3 is SIGKILLed as step 4 starts
COMPARED = (
    "reward/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/entropy",
    "response/length_mean",
)


def _assert_restarted_at_tp2_dp1(proc: subprocess.CompletedProcess, rows: list[dict]) -> None:
    """One restart after rank 3 died at the start of step 4: from the step-2 checkpoint at
    TP2 x DP1; steps 1-2 ran at 4 ranks, step 3 ran again and step 4 at 2. metrics.jsonl holds
    each step once: the rerun step 3 replaces the one logged before the kill."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    err = proc.stderr
    assert "megarl: elastic restart 1/1: rank 3 was killed by SIGKILL" in err, err[-3000:]
    assert "from step_00000002 (step 2) at TP2xPP1xDP1 (2 ranks) instead of TP2xPP1xDP2" in err
    assert "1 step(s) since the checkpoint run again" in err
    steps = [
        (r["step"], r["elastic/restarts"], r["elastic/world_size"], r["elastic/dp"]) for r in rows
    ]
    assert steps == [(1, 0, 4, 2), (2, 0, 4, 2), (3, 1, 2, 1), (4, 1, 2, 1)], steps
    assert rows[-1]["elastic/steps_lost"] == 1.0 and rows[-1]["elastic/tp"] == 2.0


@pytest.fixture(scope="module")
def resumed_by_hand(workdir, elastic_torchrun) -> dict[int, dict]:
    """The reference: the elastic run's step-2 checkpoint resumed by hand at 2 ranks (TP2)."""
    name = "step_00000002"
    ckpts = workdir / "by_hand" / "checkpoints"
    shutil.copytree(workdir / "elastic" / "checkpoints" / name, ckpts / name)
    (ckpts / "latest").write_text(name + "\n")
    proc = launch(workdir, "by_hand", QUIET, "parallel.tp=2", "trainer.total_steps=4", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return by_step(records(workdir, "by_hand"))


@pytest.fixture(scope="module")
def elastic_torchrun(workdir) -> tuple[subprocess.CompletedProcess, list[dict]]:
    proc = launch(workdir, "elastic", *ELASTIC, nproc=4, fault=KILL_AFTER_STEP_3)
    return proc, records(workdir, "elastic")


def _assert_final_steps_equal(run: dict[int, dict], reference: dict[int, dict]) -> None:
    # the same checkpoint, layout and seeds: equal up to float noise of the same computation
    for step in (3, 4):
        for key in COMPARED:
            assert run[step][key] == pytest.approx(reference[step][key], abs=1e-6), (step, key)


def test_torchrun_job_restarts_by_itself_at_fewer_ranks(workdir, elastic_torchrun, resumed_by_hand):
    proc, rows = elastic_torchrun
    _assert_restarted_at_tp2_dp1(proc, rows)
    _assert_final_steps_equal(by_step(rows), resumed_by_hand)
    [event] = [
        json.loads(x) for x in (workdir / "elastic" / "elastic.jsonl").read_text().splitlines()
    ]
    assert (event["old_layout"], event["new_layout"]) == ("TP2xPP1xDP2", "TP2xPP1xDP1")
    assert event["why"] == "rank 3 was killed by SIGKILL" and event["steps_lost"] == 1


def test_ray_job_restarts_by_itself_at_fewer_ranks(workdir, ray_head, resumed_by_hand):
    ray = ray_job(ray_head)
    proc = launch(workdir, "elastic_ray", *ELASTIC, *ray, nproc=4, fault=KILL_AFTER_STEP_3)
    rows = records(workdir, "elastic_ray")
    _assert_restarted_at_tp2_dp1(proc, rows)
    # the cluster keeps its 4 CPUs: the restart waited for the lost one (wait_s), then went on
    assert "3 of 4 ranks available; waiting up to 1 s" in proc.stderr
    _assert_final_steps_equal(by_step(rows), resumed_by_hand)
